"""``miles.testing.syncs``: which tensor operations it counts as host syncs, and where from."""
from __future__ import annotations

import torch
from miles.testing.syncs import count_syncs, syncs_per_step


def test_each_kind_of_host_sync_is_counted_once_with_its_line():
    x, mask = torch.arange(6.0), torch.arange(6) % 2 == 0
    with count_syncs() as c:
        x[0].item(), bool(x[1] > 0), int(x.argmax()), float(x[2]), range(9)[x.argmax()]
        x.cpu().tolist()  # one copy to the host; reading the host copy is free
        x.numpy(), x.to("cpu")
        x[mask], torch.nonzero(x), torch.where(mask), torch.unique(x), torch.masked_select(x, mask)
        torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3]))
        torch.tensor([1, 2], device="cpu")
    assert c.by_kind() == {"item": 5, "cpu": 1, "numpy": 1, "to_cpu": 1, "bool_index": 1, "nonzero": 2,
                           "unique": 1, "masked_select": 1, "repeat_interleave": 1, "h2d": 1}
    assert all(site.startswith(f"{__file__}:") for _, site in c.events)


def test_operations_that_stay_on_the_device_are_not_counted():
    x = torch.arange(6.0)
    with count_syncs() as c:
        torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3]), output_size=6)
        torch.arange(3).repeat_interleave(2)
        x[torch.tensor([0, 2])], x.masked_fill(x > 2, 0), torch.where(x > 2, x, 0), x.to(x.device)
        torch.isin(x, x), x.topk(2), x.sum() == 3, torch.tensor([], device="cpu"), torch.tensor([1, 2])
    assert c.total == 0, c.by_site()


def test_per_step_counts_cancel_what_a_call_does_once():
    def run(steps: int) -> None:
        torch.ones(3).tolist()  # once per call
        for _ in range(steps):
            torch.ones(1).item()

    per, extra = syncs_per_step(run, 2, 6)
    assert per == 1 and extra.by_kind() == {"item": 4}
