class StoreError(Exception):
    """A problem with host-memory buffers or checkpoint files, with the fix in the message."""
