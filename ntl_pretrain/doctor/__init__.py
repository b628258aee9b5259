"""`ntl-pretrain doctor`: one command that proves a machine trains correctly (environment, collectives, the loss on
this device, speed and memory, a short training run with resume and export, and on GPUs throughput).

    ntl-pretrain doctor [--quick] [--out REPORT.json]                    # one process
    deepspeed --num_gpus N --module ntl_pretrain.doctor [--quick]         # every rank (also multi-node)

Rank 0 prints one table row per check (ok / FAIL / skip and its figure) and writes the JSON report; the exit code
is 1 when any check failed on any rank. docs/doctor.md lists the checks and their tolerances.
"""
