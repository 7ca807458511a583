"""genrec.offline.semantic_ids.build"""
