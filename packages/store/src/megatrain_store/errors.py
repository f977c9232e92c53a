class StoreError(Exception):
    """A problem with host-memory buffers or checkpoint files, with the fix in the message."""


class WeightsError(StoreError):
    """A checkpoint or model file that is missing, damaged or another model's: the user's input to change (not the
    host's memory or the engine's state)."""
