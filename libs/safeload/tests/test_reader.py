"""A DCP folder loads through SafeReader as through torch's reader, and a planted pickle (in
.metadata or in a non-tensor item) is refused before it runs."""
import contextlib
import pickle
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from miles import MilesError
from miles_safeload import SafeReader


class Plant:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_genuine_checkpoint_loads_and_its_plain_items_come_back(tmp_path):
    dcp.save({"w": torch.arange(6.0), "tag": "step-3"}, checkpoint_id=str(tmp_path), no_dist=True)
    state = {"w": torch.zeros(6), "tag": None}
    dcp.load(state, storage_reader=SafeReader(str(tmp_path)), no_dist=True)
    assert torch.equal(state["w"], torch.arange(6.0)) and state["tag"] == "step-3"


@pytest.mark.parametrize("where", ["metadata", "item"])
def test_a_planted_pickle_is_refused_before_it_runs(tmp_path, where):
    marker = tmp_path / f"ran-{uuid.uuid4().hex}"
    folder = tmp_path / "ck"
    dcp.save({"w": torch.ones(2), "x": Plant(marker) if where == "item" else 1}, checkpoint_id=str(folder),
             no_dist=True)
    if where == "metadata":
        (folder / ".metadata").write_bytes(pickle.dumps(Plant(marker)))
    reader = SafeReader(str(folder))
    with pytest.raises(BaseException):  # noqa: B017 (DCP wraps what the reader raised in its own)
        dcp.load({"w": torch.zeros(2), "x": None}, storage_reader=reader, no_dist=True)
    assert isinstance(reader.refused, MilesError)
    assert ("unsafe .metadata" if where == "metadata" else "not plain data") in str(reader.refused)
    assert not marker.exists()
    with contextlib.suppress(BaseException):  # torch's own reader: the payload runs
        dcp.load({"w": torch.zeros(2), "x": None}, checkpoint_id=str(folder), no_dist=True)
    assert marker.exists()  # the plant is live: the refusal above is what kept it from running
