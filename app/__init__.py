"""genrec.app"""
