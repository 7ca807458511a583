"""genrec.online.decoding"""
