"""``genrec ui``: a read-only recommendation explorer in the browser (application layer).

Three pages over the behavior store, the active serving version and the workers'
metrics: a user's history and lists (``user_page``), the catalog grouped by
semantic-ID prefix with the version's quality report (``catalog_page``), and the
serving status (``status_page``). ``server`` wires them to FastAPI routes; nothing
here writes to the store, the topics or the artifacts.
"""
