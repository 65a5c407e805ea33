"""hvd.shutdown() then hvd.init() again, from every state the runtime can be left in: after a
failed collective, with requests still pending, with a DistributedOptimizer's hooks attached
in the middle of a step, with process sets registered; and shutdown after a peer has died."""
import os
import time

import pytest
import torch

from tests.harness import BACKENDS, run_ranks


def _works(hvd, tag):
    """A global collective that checks the new runtime end to end."""
    got = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name=f"ok.{tag}")
    assert got.item() == hvd.size() * (hvd.size() + 1) / 2, (tag, got)


def body_reinit_from_every_state():
    import horovod_ext.torch as hvd
    r = hvd.rank()
    log = []
    # 1. after a failed collective (shapes differ across ranks)
    try:
        hvd.allreduce(torch.ones(2 + r), name="bad_shape")
    except hvd.HorovodInternalError as exc:
        log.append(("mismatch", "mismatched shape" in str(exc)))
    hvd.shutdown()
    hvd.init()
    _works(hvd, 1)
    # 2. with a request that only rank 0 submitted, still pending at shutdown
    pending = hvd.allreduce_async(torch.ones(1), name="lonely") if r == 0 else None
    try:
        hvd.shutdown()
        log.append(("shutdown_error", None))
    except hvd.HorovodInternalError as exc:
        log.append(("shutdown_error", "lonely" in str(exc)))
    if pending is not None:
        try:
            hvd.synchronize(pending)
            log.append(("pending", "completed"))
        except hvd.HorovodInternalError:
            log.append(("pending", "failed"))
    hvd.init()
    _works(hvd, 2)
    # 3. a DistributedOptimizer whose hooks fired on rank 0 only, then shutdown mid-step
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(r))
    if r == 0:
        model(x).pow(2).mean().backward()   # its gradients' requests are now in flight
    hvd.barrier()   # shutdown is collective: rank 1 must not stop the engines before that
    try:
        hvd.shutdown()
    except hvd.HorovodInternalError:
        pass                                 # rank 0: the gradients were never matched
    hvd.init()
    for _ in range(2):                       # the same optimizer keeps working
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    weights = hvd.allgather(torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                            .reshape(1, -1))
    log.append(("weights_agree", bool(torch.equal(weights[0], weights[-1]))))
    # 4. with process sets registered (and dynamic sets allowed by init's argument)
    hvd.shutdown()
    hvd.init(process_sets="dynamic")
    first = hvd.add_process_set([0])
    hvd.shutdown()
    log.append(("set_invalidated", first.process_set_id is None))
    hvd.init(process_sets="dynamic")
    again = hvd.add_process_set([0])
    log.append(("set_again", again.size()))
    _works(hvd, 4)
    return log


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reinit_from_every_state(backend):
    logs = run_ranks(body_reinit_from_every_state, 2, backend, timeout=120)
    for r, log in enumerate(logs):
        entries = dict(log)
        assert entries["mismatch"] is True, log
        assert entries["weights_agree"] is True, log
        assert entries["set_invalidated"] is True and entries["set_again"] == 1, log
        # every rank's shutdown names the request left unmatched, not only its submitter's
        assert entries["shutdown_error"] is True, log
    assert dict(logs[0])["pending"] == "failed", logs[0]


def body_shutdown_after_peer_died():
    import horovod_ext.torch as hvd
    if hvd.rank() == 1:
        os._exit(3)
    started = time.monotonic()
    try:
        hvd.allreduce(torch.ones(1), name="to_the_dead")
        outcome = "completed"
    except hvd.HorovodInternalError as exc:
        outcome = str(exc)
    try:
        hvd.shutdown()
    except hvd.HorovodInternalError:
        pass
    return outcome, time.monotonic() - started, hvd.is_initialized()


@pytest.mark.timeout(90)
def test_shutdown_after_a_peer_died_returns():
    failure = run_ranks(body_shutdown_after_peer_died, 2, "gloo", expect_failure=True,
                        env={"HOROVOD_COMM_TIMEOUT_SECONDS": "5"}, timeout=60, settle_on=[0])
    outcome, seconds, initialized = failure.results[0]
    assert outcome != "completed" and "rank 1" in outcome, outcome
    assert seconds < 30 and initialized is False
