"""A sandbox's life through E2B's control plane: a timeout set short ends
it (Clade counts the timeout from the sandbox's last use), a pause keeps
its files and its running processes until a connect resumes it, and a
snapshot makes new sandboxes that start with the source's files."""

from __future__ import annotations

import time

import pytest
from e2b import CommandExitException, Sandbox, SandboxNotFoundException, SandboxQuery, SandboxState

from conftest import REQUEST_TIMEOUT, RUN, list_all, new_sandbox, own_sandbox, wait_for

# A timeout short enough to wait for (the reaper looks when it comes due).
SHORT_TIMEOUT = 10
# How long the end of a short timeout may take to show.
GONE_WITHIN = SHORT_TIMEOUT + 90
# How long a command may take around a pause or resume (a restore under TCG).
COMMAND_TIMEOUT = 120


def listed_ids(**query) -> set:
    """This run's sandboxes in the list. Listing is not a use of a sandbox,
    so it does not put its timeout off."""
    return {info.sandbox_id for info in list_all(SandboxQuery(metadata={"run": RUN}, **query))}


def test_a_short_timeout_ends_an_unused_sandbox(e2b):
    with own_sandbox(metadata={"purpose": "timeout"}) as sandbox:
        assert sandbox.commands.run("echo used", timeout=COMMAND_TIMEOUT).stdout == "used\n"
        sandbox.set_timeout(SHORT_TIMEOUT)
        started = time.monotonic()
        wait_for(lambda: sandbox.sandbox_id not in listed_ids(), timeout=GONE_WITHIN, interval=3,
                 what=f"the sandbox gone {SHORT_TIMEOUT} s after its last use")
        print(f"gone {time.monotonic() - started:.0f} s after set_timeout({SHORT_TIMEOUT})")
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(sandbox.sandbox_id, request_timeout=REQUEST_TIMEOUT)
        assert sandbox.kill() is False


def test_a_timeout_of_zero_ends_a_sandbox_or_pauses_an_auto_pause_one_at_once(e2b):
    # E2B's 0 is now (Clade's own ttl_seconds 0 is never).
    with own_sandbox(metadata={"purpose": "timeout-zero"}) as sandbox:
        sandbox.set_timeout(0)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(sandbox.sandbox_id, request_timeout=REQUEST_TIMEOUT)
    with own_sandbox(metadata={"purpose": "timeout-zero-pause"}, lifecycle={"on_timeout": "pause"}) as sandbox:
        sandbox.files.write("/home/user/kept.txt", "paused at once")
        sandbox.set_timeout(0)
        assert Sandbox.get_info(sandbox.sandbox_id, request_timeout=REQUEST_TIMEOUT).state == SandboxState.PAUSED
        resumed = Sandbox.connect(sandbox.sandbox_id, timeout=3600, request_timeout=REQUEST_TIMEOUT)
        assert resumed.files.read("/home/user/kept.txt") == "paused at once"


def test_an_auto_pause_sandbox_pauses_at_its_timeout_and_resumes(e2b):
    with own_sandbox(metadata={"purpose": "auto-pause"}, timeout=SHORT_TIMEOUT, lifecycle={"on_timeout": "pause"}) as sandbox:
        sandbox.files.write("/home/user/kept.txt", "before the timeout")
        started = time.monotonic()
        wait_for(lambda: sandbox.sandbox_id in listed_ids(state=[SandboxState.PAUSED]), timeout=GONE_WITHIN, interval=3,
                 what=f"the sandbox paused {SHORT_TIMEOUT} s after its last use")
        print(f"paused {time.monotonic() - started:.0f} s after its last use (timeout {SHORT_TIMEOUT} s)")
        resumed = Sandbox.connect(sandbox.sandbox_id, timeout=3600, request_timeout=REQUEST_TIMEOUT)
        assert resumed.files.read("/home/user/kept.txt") == "before the timeout"


def test_a_paused_sandbox_resumes_on_connect_with_its_files_and_processes(e2b):
    with own_sandbox(metadata={"purpose": "pause"}) as sandbox:
        sandbox.files.write("/home/user/kept.txt", "before the pause")
        # A process of its own session, so that it is nobody's stream: only
        # the sandbox's memory keeps it (a cold boot would not have it).
        started = sandbox.commands.run(
            "setsid sleep 3600 </dev/null >/dev/null 2>&1 & echo $!", timeout=COMMAND_TIMEOUT)
        pid = int(started.stdout.strip())
        assert sandbox.commands.run(f"kill -0 {pid}", timeout=COMMAND_TIMEOUT).exit_code == 0
        # And a background command whose stream is still open: it runs on
        # through the pause, as on E2B.
        streamed = sandbox.commands.run("sleep 3601", background=True, timeout=0)

        assert sandbox.pause() is True
        assert Sandbox.get_info(sandbox.sandbox_id, request_timeout=REQUEST_TIMEOUT).state == SandboxState.PAUSED
        assert sandbox.sandbox_id in listed_ids(state=[SandboxState.PAUSED])
        assert sandbox.sandbox_id not in listed_ids(state=[SandboxState.RUNNING])
        # Pausing what is paused already says so; its envd's health probe
        # fails (and wakes nothing).
        assert sandbox.pause() is False
        assert sandbox.is_running(request_timeout=REQUEST_TIMEOUT) is False
        assert Sandbox.get_info(sandbox.sandbox_id, request_timeout=REQUEST_TIMEOUT).state == SandboxState.PAUSED

        resumed = Sandbox.connect(sandbox.sandbox_id, timeout=3600, request_timeout=REQUEST_TIMEOUT)
        assert resumed.sandbox_id == sandbox.sandbox_id and resumed.is_running(request_timeout=REQUEST_TIMEOUT)
        # A connect never shortens a sandbox's time.
        Sandbox.connect(sandbox.sandbox_id, timeout=5, request_timeout=REQUEST_TIMEOUT)
        info = Sandbox.get_info(sandbox.sandbox_id, request_timeout=REQUEST_TIMEOUT)
        assert (info.end_at - info.started_at).total_seconds() > 600, info
        assert Sandbox.get_info(sandbox.sandbox_id, request_timeout=REQUEST_TIMEOUT).state == SandboxState.RUNNING
        assert resumed.files.read("/home/user/kept.txt") == "before the pause"
        cmdline = resumed.commands.run(f"tr '\\0' ' ' < /proc/{pid}/cmdline", timeout=COMMAND_TIMEOUT).stdout
        assert cmdline.strip() == "sleep 3600", cmdline
        cmdline = resumed.commands.run(f"tr '\\0' ' ' < /proc/{streamed.pid}/cmdline", timeout=COMMAND_TIMEOUT).stdout
        assert cmdline.strip() == "sleep 3601", cmdline
        # The handle made before the pause works again too.
        assert sandbox.commands.run("echo awake", timeout=COMMAND_TIMEOUT).stdout == "awake\n"


BOOT_ID = "/proc/sys/kernel/random/boot_id"


def test_a_filesystem_only_pause_boots_the_disk_on_connect_with_its_files_and_envs(e2b):
    with own_sandbox(metadata={"purpose": "pause-filesystem"}, envs={"KEPT_VAR": "from the create"}) as sandbox:
        sandbox.files.write("/home/user/kept.txt", "before the pause")
        boot_before = sandbox.files.read(BOOT_ID).strip()
        started = sandbox.commands.run("setsid sleep 3600 </dev/null >/dev/null 2>&1 & echo $!", timeout=COMMAND_TIMEOUT)
        pid = int(started.stdout.strip())

        assert sandbox.pause(mode="filesystem") is True
        assert Sandbox.get_info(sandbox.sandbox_id, request_timeout=REQUEST_TIMEOUT).state == SandboxState.PAUSED
        assert sandbox.is_running(request_timeout=REQUEST_TIMEOUT) is False

        resumed = Sandbox.connect(sandbox.sandbox_id, timeout=3600, request_timeout=REQUEST_TIMEOUT)
        assert resumed.sandbox_id == sandbox.sandbox_id
        assert resumed.files.read(BOOT_ID).strip() != boot_before, "the wake booted the disk"
        assert resumed.files.read("/home/user/kept.txt") == "before the pause"
        # What the create set is the sandbox's still; what ran in memory is gone.
        assert resumed.commands.run("echo $KEPT_VAR", timeout=COMMAND_TIMEOUT).stdout == "from the create\n"
        assert _gone(resumed, pid), "a process of the old boot still runs"
        # A memory pause of the booted sandbox keeps that boot.
        assert resumed.pause() is True
        again = Sandbox.connect(sandbox.sandbox_id, timeout=3600, request_timeout=REQUEST_TIMEOUT)
        assert again.files.read(BOOT_ID).strip() == resumed.files.read(BOOT_ID).strip()


def _gone(sandbox: Sandbox, pid: int) -> bool:
    """Whether no process `pid` runs `sleep 3600` in the sandbox."""
    out = sandbox.commands.run(f"tr '\\0' ' ' < /proc/{pid}/cmdline 2>/dev/null || true", timeout=COMMAND_TIMEOUT)
    return out.stdout.strip() != "sleep 3600"


def test_a_filesystem_only_auto_pause_at_the_timeout_boots_the_disk_on_connect(e2b):
    lifecycle = {"on_timeout": {"action": "pause", "mode": "filesystem"}}
    with own_sandbox(metadata={"purpose": "auto-pause-filesystem"}, timeout=SHORT_TIMEOUT, lifecycle=lifecycle) as sandbox:
        sandbox.files.write("/home/user/kept.txt", "before the timeout")
        boot_before = sandbox.files.read(BOOT_ID).strip()
        wait_for(lambda: sandbox.sandbox_id in listed_ids(state=[SandboxState.PAUSED]), timeout=GONE_WITHIN, interval=3,
                 what=f"the sandbox paused {SHORT_TIMEOUT} s after its last use")
        resumed = Sandbox.connect(sandbox.sandbox_id, timeout=3600, request_timeout=REQUEST_TIMEOUT)
        assert resumed.files.read(BOOT_ID).strip() != boot_before, "the wake booted the disk"
        assert resumed.files.read("/home/user/kept.txt") == "before the timeout"


def test_background_commands_are_listed_followed_fed_and_killed_after_a_pause(e2b):
    with own_sandbox(metadata={"purpose": "pause-processes"}) as sandbox:
        waiting = sandbox.commands.run(
            'echo started; read line; echo "got $line"; exit 7', background=True, stdin=True, timeout=0)
        sleeper = sandbox.commands.run("sleep 3602", background=True, timeout=0)
        wait_for(lambda: {waiting.pid, sleeper.pid} <= {p.pid for p in sandbox.commands.list()}, timeout=30,
                 what="both commands listed")

        assert sandbox.pause() is True
        resumed = Sandbox.connect(sandbox.sandbox_id, timeout=3600, request_timeout=REQUEST_TIMEOUT)
        # The new agent session takes both up again: listed as before the pause.
        listed = {process.pid: process for process in resumed.commands.list(request_timeout=REQUEST_TIMEOUT)}
        assert {waiting.pid, sleeper.pid} <= listed.keys(), listed
        assert "sleep 3602" in " ".join([listed[sleeper.pid].cmd, *listed[sleeper.pid].args]), listed[sleeper.pid]

        # Followed again, and fed: its input reaches it in the new session.
        again = resumed.commands.connect(waiting.pid, timeout=COMMAND_TIMEOUT)
        resumed.commands.send_stdin(waiting.pid, "hello\n", request_timeout=REQUEST_TIMEOUT)
        with pytest.raises(CommandExitException) as raised:
            again.wait()
        assert raised.value.exit_code == 7 and "got hello\n" in raised.value.stdout, raised.value
        # The stream opened before the pause stayed with it throughout.
        with pytest.raises(CommandExitException) as raised:
            waiting.wait()
        assert raised.value.exit_code == 7 and raised.value.stdout == "started\ngot hello\n", raised.value

        # A signal reaches the other one.
        assert resumed.commands.kill(sleeper.pid, request_timeout=REQUEST_TIMEOUT) is True
        wait_for(lambda: not {waiting.pid, sleeper.pid} & {p.pid for p in resumed.commands.list()}, timeout=30,
                 what="both ended commands gone from the list")
        with pytest.raises(CommandExitException):
            sleeper.wait()


def test_a_snapshot_starts_new_sandboxes_with_the_sources_files(e2b):
    with own_sandbox(metadata={"purpose": "snapshot-source"}) as source:
        source.files.write("/home/user/snapshotted.txt", "in the snapshot")
        snapshot = source.create_snapshot()
        assert snapshot.snapshot_id
        try:
            # The source goes on after it.
            source.files.write("/home/user/after.txt", "not in the snapshot")
            assert source.commands.run("cat /home/user/snapshotted.txt", timeout=COMMAND_TIMEOUT).stdout \
                == "in the snapshot"
            listed = Sandbox.list_snapshots(sandbox_id=source.sandbox_id, request_timeout=REQUEST_TIMEOUT).next_items()
            assert snapshot.snapshot_id in {s.snapshot_id for s in listed}, listed

            child = new_sandbox(metadata={"purpose": "from-snapshot"}, template=snapshot.snapshot_id)
            try:
                assert child.sandbox_id != source.sandbox_id
                assert child.files.read("/home/user/snapshotted.txt") == "in the snapshot"
                assert not child.files.exists("/home/user/after.txt")
                # The two are apart from here on.
                child.files.write("/home/user/snapshotted.txt", "changed in the child")
                assert source.files.read("/home/user/snapshotted.txt") == "in the snapshot"
            finally:
                child.kill()
        finally:
            assert Sandbox.delete_snapshot(snapshot.snapshot_id, request_timeout=REQUEST_TIMEOUT) is True
        assert Sandbox.delete_snapshot(snapshot.snapshot_id, request_timeout=REQUEST_TIMEOUT) is False


def test_a_named_snapshot_is_listed_and_started_by_its_name(e2b):
    name = f"e2b-snap-{RUN}"
    with own_sandbox(metadata={"purpose": "named-snapshot"}) as source:
        source.files.write("/home/user/named.txt", "in the named snapshot")
        snapshot = source.create_snapshot(name=name)
        try:
            assert snapshot.names == [name], snapshot
            listed = Sandbox.list_snapshots(name=name, request_timeout=REQUEST_TIMEOUT).next_items()
            assert [s.snapshot_id for s in listed] == [snapshot.snapshot_id], listed
            assert listed[0].names == [name]
            # E2B's filter takes an id too; a name nobody has finds nothing.
            by_id = Sandbox.list_snapshots(name=snapshot.snapshot_id, request_timeout=REQUEST_TIMEOUT).next_items()
            assert [s.snapshot_id for s in by_id] == [snapshot.snapshot_id]
            assert Sandbox.list_snapshots(name=f"{name}-none", request_timeout=REQUEST_TIMEOUT).next_items() == []

            # Its name is a template name, as on E2B.
            child = new_sandbox(metadata={"purpose": "from-named-snapshot"}, template=name)
            try:
                assert child.files.read("/home/user/named.txt") == "in the named snapshot"
            finally:
                child.kill()
        finally:
            assert Sandbox.delete_snapshot(name, request_timeout=REQUEST_TIMEOUT) is True
        assert Sandbox.list_snapshots(name=name, request_timeout=REQUEST_TIMEOUT).next_items() == []
