"""Everything about Slurm: the job's environment (topology, hostlists, node names), ``sbatch`` /
``scontrol`` calls, exclusion of bad nodes, and the sbatch templates users copy (``templates/``).
"""

from pathlib import Path

# The sbatch templates ship inside the package (in the wheel too): copy them from here.
TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
