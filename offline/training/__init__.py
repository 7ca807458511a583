"""genrec.offline.training"""
