"""grpo_dist.distributed.cuda_device: which GPU and process-group backend a rank takes. One rank per GPU is the
ordinary case (GPU LOCAL_RANK, nccl); more ranks on a node than GPUs (1 trainer + 1 rollout rank on the one GPU
of bench/gpu_check.sh) is refused with one line, unless GRPO_DIST_SHARE_GPU=1 asks for it: then the ranks wrap
around the GPUs and every rank runs gloo, since NCCL refuses two ranks of one communicator on one GPU. A pure
function, so a CPU can check every case."""

import pytest
import torch

from grpo_dist.distributed import cuda_device

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("share", [False, True])
def test_one_rank_per_gpu_takes_its_local_rank_and_nccl(share):
    # GRPO_DIST_SHARE_GPU changes nothing where every rank has its own GPU
    assert [cuda_device(r, 4, 4, share) for r in range(4)] == [(torch.device("cuda", r), "nccl") for r in range(4)]
    assert cuda_device(1, 2, 8, share) == (torch.device("cuda", 1), "nccl")


def test_two_ranks_on_one_gpu_share_gpu_0_over_gloo():
    assert cuda_device(0, 2, 1, True) == (torch.device("cuda", 0), "gloo")
    assert cuda_device(1, 2, 1, True) == (torch.device("cuda", 0), "gloo")
    # 4 ranks on 2 GPUs: two per GPU, rank r on GPU r mod 2; rank 0 too runs gloo (every rank agrees)
    assert [cuda_device(r, 4, 2, True) for r in range(4)] == [
        (torch.device("cuda", 0), "gloo"), (torch.device("cuda", 1), "gloo"),
        (torch.device("cuda", 0), "gloo"), (torch.device("cuda", 1), "gloo")]


@pytest.mark.parametrize("local_rank", [0, 1])
def test_more_ranks_than_gpus_is_refused_without_the_opt_in(local_rank):
    # rank 0 is refused as well: it would otherwise start nccl alone and wait for a rank that cannot join
    with pytest.raises(RuntimeError) as e:
        cuda_device(local_rank, 2, 1, False)
    assert str(e.value) == (f"LOCAL_RANK {local_rank} of 2 ranks on this node, 1 visible GPU(s): launch at most one "
                            "rank per GPU (torchrun --nproc_per_node 1), or set GRPO_DIST_SHARE_GPU=1 to put several "
                            "ranks on one GPU (gloo process groups, not nccl)")
