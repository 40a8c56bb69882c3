"""What a pool goes through, built from the other rooms: provision, scrub, teardown and release,
and the status read back from disk and the kernel.
"""
