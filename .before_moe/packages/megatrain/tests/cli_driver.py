"""Runs `megatrain` command lines through `megatrain.cli.main`, as the console script does, one after
another in this one process (torch is imported once), and prints for each its exit code and everything it
wrote (an exception that escapes is printed as the interpreter would, traceback included) as a JSON line.

Reads the command lines as JSON lists, one per line, from stdin."""

import contextlib
import io
import json
import sys
import traceback

from megatrain.cli import main

for line in sys.stdin:
    argv = json.loads(line)
    output = io.StringIO()
    with contextlib.redirect_stderr(output), contextlib.redirect_stdout(output):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
        except BaseException:
            traceback.print_exc()
            code = 1
    print(json.dumps({"argv": argv, "code": code, "output": output.getvalue()}), flush=True)
