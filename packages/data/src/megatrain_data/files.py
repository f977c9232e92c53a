"""The user's text files read with one-line errors: where a file is not UTF-8, and the text of one a setting names."""

from pathlib import Path

from .errors import DataError, missing_path


def not_utf8_where(path: Path, chunk_bytes: int = 1 << 24) -> str | None:
    """Where the file's first byte that is not UTF-8 lies, in words ("PATH line 3, byte offset 41 (0xff) is not
    UTF-8"); None where the whole file is UTF-8. Read in chunks: a dataset may be larger than memory."""
    offset, line, carried = 0, 1, b""
    with open(path, "rb") as file:
        while True:
            chunk = carried + file.read(chunk_bytes)
            at_end = len(chunk) == len(carried)
            try:
                chunk.decode("utf-8")
                carried = b""
            except UnicodeDecodeError as error:
                # (a character cut by the chunk's end is whole in the next one)
                if error.reason == "unexpected end of data" and not at_end:
                    chunk, carried = chunk[: error.start], chunk[error.start :]
                else:
                    line += chunk.count(b"\n", 0, error.start)
                    return (
                        f"{path} line {line}, byte offset {offset + error.start} "
                        f"(0x{chunk[error.start]:02x}) is not UTF-8"
                    )
            if at_end:
                return None
            line += chunk.count(b"\n")
            offset += len(chunk)


def read_text_file(path: Path, what: str) -> str:
    """The text of the UTF-8 file `path` (a setting's, named `what`), or a `DataError` saying what is wrong with it: not
    UTF-8 (where), a directory, missing or unreadable, empty."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{what} {not_utf8_where(path)}; save it as UTF-8") from None
    except IsADirectoryError:
        raise DataError(f"{what} {path} is a directory; name a text file in it") from None
    except OSError as error:
        where = missing_path(path) if isinstance(error, FileNotFoundError) else path
        raise DataError(f"cannot read {what} {where}: {error.strerror}; check the path and its permissions") from error
    if not text.strip():
        raise DataError(f"{what} {path} is empty")
    return text
