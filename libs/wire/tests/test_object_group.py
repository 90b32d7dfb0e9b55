"""miles_wire.object_group: one gloo group per default group, reused until dropped."""
import torch.distributed as dist

import miles_wire as W


def test_gloo_default_group_is_used_as_is(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert W.object_group() is None


def test_one_gloo_group_per_default_group_until_dropped(monkeypatch):
    made = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda backend=None: made.append(backend) or object())
    W.drop_object_groups()
    first = W.object_group()
    assert W.object_group() is first and made == ["gloo"]
    W.drop_object_groups()  # the default group was destroyed: a new one gets its own
    assert W.object_group() is not first and made == ["gloo", "gloo"]
    W.drop_object_groups()
