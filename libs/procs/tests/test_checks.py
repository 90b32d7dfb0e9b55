"""The launchers' input checks: each bad value is a MilesError (exit 2) naming the flag and the fix."""
import socket

import pytest
from miles import MilesError
from miles_procs import distinct_ports, free_port, work_folder


def test_free_port_names_a_busy_port_and_one_out_of_range():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        with pytest.raises(MilesError) as e:
            free_port("--port", busy)
    assert e.value.exit_code == 2
    assert str(e.value).startswith(f"--port {busy}: 127.0.0.1:{busy} is in use (")
    assert str(e.value).endswith("); pass a free --port or stop what listens there")
    assert free_port("--port", busy) == busy  # nothing listens there any more
    for bad in (0, -1, 65536):
        with pytest.raises(MilesError, match=rf"^--head-port {bad} is not a TCP port; pass one in 1\.\.65535$"):
            free_port("--head-port", bad)


def test_distinct_ports_names_the_two_flags_that_collide():
    distinct_ports({"--agent-port": 8100, "--head-port": 11000})
    with pytest.raises(MilesError) as e:
        distinct_ports({"--a": 1, "--agent-port": 9100, "--head-port": 9100})
    assert str(e.value) == "--agent-port and --head-port are both 9100; give them different ports"
    assert e.value.exit_code == 2


def test_work_folder_is_created_or_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert work_folder("runs/w") == tmp_path / "runs" / "w" and (tmp_path / "runs" / "w").is_dir()
    assert work_folder("runs/w") == tmp_path / "runs" / "w"  # an existing folder is fine
    (tmp_path / "file").write_text("")
    for path in ("file", "file/w"):
        with pytest.raises(MilesError) as e:
            work_folder(path, "--data-dir")
        assert str(e.value).startswith(f"--data-dir {path}: cannot create the folder (")
        assert str(e.value).endswith("); pass a folder path you can write to")
    assert (tmp_path / "file").read_text() == ""
