"""Everything about Slurm: the job's environment (topology, hostlists, node names), ``sbatch`` /
``scontrol`` calls, exclusion of bad nodes, and the sbatch templates users copy (``templates/``).
"""
