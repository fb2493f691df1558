"""A run on disk: its typed config, the run directory (atomic files, manifests, the lock), the
stage contract (stage names, typed manifests), the Arrow trajectory store, prompt files, the
metrics log and the seeds everything random is drawn from."""
