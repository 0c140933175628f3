# Runs a Clade function in its sandbox (written to /fn/.clade/run.py at
# deploy, kept in the function's snapshot): `python3 run.py ENTRYPOINT`.
#
# The invocation's input arrives as JSON on stdin. A module that defines
# `handler` is loaded (its `if __name__ == "__main__"` block does not run)
# and `handler(event)` is called, or `handler(event, context)` when it takes
# two arguments; an async handler is awaited. What it returns is written as
# JSON to $CLADE_OUTPUT, the run's output. A module without a handler runs
# as a script, with the input on its stdin. An uncaught exception prints its
# traceback and exits 1, as Python does.
#
# It imports only what every run needs (asyncio only for an async
# handler): a run pays for each import again, in a freshly restored VM.
import ast
import io
import json
import os
import runpy
import sys

ROOT = "/fn"


def defines_handler(path):
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read(), path)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "handler":
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "handler" for t in node.targets):
            return True
    return False


def main():
    entry = os.path.join(ROOT, sys.argv[1])
    sys.path[:0] = [os.path.dirname(entry), ROOT, os.path.join(ROOT, ".packages")]
    raw = sys.stdin.read()
    try:
        event = json.loads(raw) if raw.strip() else None
    except ValueError:
        event = raw
    sys.argv = [entry]
    sys.stdin = io.StringIO(raw)
    if not defines_handler(entry):
        runpy.run_path(entry, run_name="__main__")
        return
    handler = runpy.run_path(entry, run_name="__clade_function__")["handler"]
    context = {"function_id": os.environ.get("CLADE_FUNCTION_ID"), "run_id": os.environ.get("CLADE_RUN_ID")}
    code = getattr(handler, "__code__", None)
    takes_context = code is not None and code.co_argcount - (1 if hasattr(handler, "__self__") else 0) >= 2
    result = handler(event, context) if takes_context else handler(event)
    if hasattr(result, "__await__"):
        import asyncio

        async def wait():
            return await result
        result = asyncio.run(wait())
    sys.stdout.flush()
    with open(os.environ["CLADE_OUTPUT"], "w", encoding="utf-8") as out:
        json.dump(result, out, default=str)


main()
