"""Run under torchrun by test_comm_exit.py: a few control messages and pipeline sends over gloo, then a
plain return from main, as every SPMD script ends."""



import torch  # noqa: E402

from moe_serve.parallel import comm  # noqa: E402
from moe_serve.parallel.config import ParallelConfig  # noqa: E402
from moe_serve.parallel.state import init_parallel  # noqa: E402


def main() -> None:
    state = init_parallel(ParallelConfig(pipeline_parallel_size=2))
    pp = state.pp
    for step in range(3):
        if pp.index == 0:
            comm.send_tensor(torch.randn(5 + step, 64), 1, pp)
        else:
            comm.recv_tensor(0, pp)
        assert comm.broadcast_object({"step": step}, pp, src=1) == {"step": step}
    print(f"rank {state.rank} done", flush=True)


if __name__ == "__main__":
    main()
