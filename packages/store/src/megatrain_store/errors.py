class StoreError(Exception):
    """A problem with host-memory buffers or checkpoint files, with the fix in the message."""


class CheckpointError(StoreError):
    """A checkpoint named to resume, evaluate or convert that is damaged or incomplete: the user's input to change."""
