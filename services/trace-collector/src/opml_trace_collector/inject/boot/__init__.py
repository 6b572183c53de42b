"""Not imported: this folder goes on a traced job's PYTHONPATH for its ``sitecustomize.py`` (the
``__init__`` only makes packaging ship the folder with the wheel)."""
