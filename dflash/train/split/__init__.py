"""The split run: target-worker ranks stream packed target batches to drafter-trainer ranks
over torch.distributed point-to-point messages (NCCL on GPU, gloo on CPU). No side store.

One job (torchrun / accelerate launch), two layouts (topology.mode):
- colocated: every rank runs target + drafter on its device, data parallel over all ranks
  (`dflash.train.colocated`, the single-process run with a rank context).
- split: ranks 0..NW-1 are target workers, ranks NW..NW+ND-1 drafter trainers (DP among
  themselves), NW = topology.num_target_ranks, any ratio.

Determinism (Schedule): step s has G = ND * grad_accum global micro-batches j = a*ND + d, the
layout colocated DP uses (trainer d, accumulation slot a). Micro-batch j of step s holds the
stream positions start_position + ((s - start_step)*G + j) * mb ..+mb, and worker g % NW
(g = s*G + j) produces it. Trainers consume in that order whatever the timing, so a split run
trains on exactly what a colocated run with ND ranks trains on, and a resumed run continues at
the checkpoint's stream position.

Wire format per micro-batch (`dflash.common.comm.Outbox`, see `wire`): a header (meta ints, dtypes, shapes), one int64
tensor with ids/positions/segments/loss mask/next tokens/sample ids/row seeds, the aux states
[N, T, K*H] in the target dtype, and the final hidden states only for the soft loss. The
header also carries the worker's cumulative counters, which the trainers turn into pipe/*.

Modules: `schedule` (roles and the deterministic schedule), `wire` (one micro-batch as a
message), `worker` (the target-worker role), `heads` (what a trainer loads of the target),
`trainer` (the drafter-trainer role), `receiver` (the trainer's batch source), `run` (both).
"""
