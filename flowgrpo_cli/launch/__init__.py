"""Running stages as SPMD ranks: the process group and its collectives, how a rank's error
reaches the launcher, and the one stage skeleton every stage runs through. Ray clusters past
one host launch these from above the stages (flowgrpo_cli/ray_cluster.py)."""
