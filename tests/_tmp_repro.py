import sys, torch

def body_ops(numels):
    import horovod_ext.torch as hvd
    r = hvd.rank()
    ops = {"onebit": hvd.OneBit, "randomk": hvd.RandomK(0.5), "powersgd": hvd.PowerSGD(rank=1),
           "quantized": hvd.Quantized(bits=4), "adasum": hvd.Adasum, "sum": hvd.Sum, "avg": hvd.Average}
    done = []
    for name, op in ops.items():
        for numel in numels:
            x = torch.randn(numel, generator=torch.Generator().manual_seed(r))
            try:
                out = hvd.allreduce(x, op=op, name=f"{name}.{numel}")
                done.append((name, numel, "ok" if out.shape == x.shape else f"shape {out.shape}"))
            except Exception as e:
                done.append((name, numel, type(e).__name__ + ": " + str(e)[:200]))
                if "stopped" in str(e): raise
    return done
