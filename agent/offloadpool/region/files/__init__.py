"""A pool's files and their checks: where a pool lives, names opened beneath a descriptor, the
segment plan, the manifest, the record and the populate journal, the layout files, migration.

The node trusts only what this room opened without following a link (``beneath``) under the
places it defines (``places``).
"""
