"""Running stages as SPMD ranks: the process group and its collectives, the one stage skeleton
every stage runs through, and Ray clusters past one host."""
