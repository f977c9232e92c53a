"""The data package's error: data (or a data setting) a run cannot read, with the fix in the message."""


class DataError(Exception):
    """Data the pipeline cannot read or use (a missing file, a bad record, a setting the data cannot take), with
    the offending value and what to do."""


def missing_path(path) -> str:
    """A path that is not there, as a message names it: a relative one with where it was looked for (a config's paths
    are read from the current directory, not the config file's)."""
    from pathlib import Path

    path = Path(path)
    return (
        str(path) if path.is_absolute() else f"{path} ({Path.cwd() / path}: paths are read from the current directory)"
    )
