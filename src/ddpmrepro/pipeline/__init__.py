"""Pipeline plumbing: the DVC -> Snakemake bridge and the check_params stage."""
