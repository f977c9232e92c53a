"""The data package's error: data (or a data setting) a run cannot read, with the fix in the message."""


class DataError(Exception):
    """Data the pipeline cannot read or use (a missing file, a bad record, a setting the data cannot take), with
    the offending value and what to do."""
