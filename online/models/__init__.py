"""genrec.online.models"""
