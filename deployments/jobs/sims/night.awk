# One shard of the ten thousand simulations: one night of a 4-GPU host taking queued jobs of random
# length (1.2 h on average) from 22:00 for 9 hours, and how many of them finish by 07:00.
#
#   E31_SHARD_INDEX=7 E31_OUTPUT_DIR=/tmp/out awk -f night.awk
#
# Shard i simulates night i (seeded by SEED and i), so the shards are independent nights and any
# shard can be run again alone. It writes finished.txt to its own folder (E31_OUTPUT_DIR); the
# reduce step (summarize.py) combines them. awk, because it starts in milliseconds: ten thousand
# Python interpreters would spend more time starting than simulating.
BEGIN {
    shard = ENVIRON["E31_SHARD_INDEX"] + 0
    srand((ENVIRON["SEED"] + 0) * 100003 + shard)
    gpus = 4; hours = 9; finished = 0
    for (g = 0; g < gpus; g++) free_at[g] = 0
    while (1) {
        first = 0  # the GPU that frees up first takes the next job
        for (g = 1; g < gpus; g++) if (free_at[g] < free_at[first]) first = g
        ends = free_at[first] - log(1 - rand()) * 1.2
        if (ends > hours) break
        finished++
        free_at[first] = ends
    }
    print finished > (ENVIRON["E31_OUTPUT_DIR"] "/finished.txt")
}
