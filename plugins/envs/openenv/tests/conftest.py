import os
import subprocess
import sys
import time
import urllib.request

import pytest
from miles_procs import unused_port


@pytest.fixture(scope="session")
def server_url(tmp_path_factory):
    """The bundled game served by OpenEnv's create_app under uvicorn, in its own process."""
    port = unused_port()
    log = tmp_path_factory.mktemp("openenv") / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "miles_plugin_openenv.server", "--port", str(port)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180  # importing openenv pulls in gradio: slow on a busy machine
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"OpenEnv server did not come up: {log.read_text()[-2000:]}")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
