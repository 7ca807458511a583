"""genrec.app.bench"""
