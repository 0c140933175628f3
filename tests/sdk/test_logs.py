"""Logs (§3.6): the VM's console as text, and followed as SSE."""

import threading

from conftest import wait_for


def test_logs_as_text(sandbox):
    lines = list(sandbox.logs())
    assert lines, "the console log of a running VM is not empty"
    assert all(isinstance(line, str) and "\n" not in line for line in lines)


def test_logs_follow_yields_new_lines(sandbox):
    marker = "clade-sdk-follow-marker"
    seen = []
    errors = []
    done = threading.Event()
    stream = sandbox.logs(follow=True)  # a generator: the request is sent on the first next()

    def read():
        try:
            for line in stream:
                seen.append(line)
                if marker in line:
                    break
        except Exception as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    # Something the console prints: a kernel message.
    wait_for(lambda: sandbox.exec(f"echo {marker} > /dev/console; echo {marker} > /dev/kmsg") and done.wait(2),
             timeout=60, what="the marker in the followed log")
    assert not errors, errors
    assert any(marker in line for line in seen)
    assert all("\n" not in line for line in seen)


def test_logs_stream_picks_the_console_or_the_vmms_errors(sandbox):
    marker = "clade-sdk-stream-marker"
    sandbox.exec(f"echo {marker} > /dev/console")
    assert any(marker in line for line in sandbox.logs(stream="stdout"))
    assert any(marker in line for line in sandbox.logs(stream="both"))
    assert not any(marker in line for line in sandbox.logs(stream="stderr")), "the VMM's own errors only"
