"""The vision-inspection story's steps, one module each, run in order by ``scripts/main_job.py``.

Each module's ``run(story)`` does its step against the live services, prints what it shows as it
goes, and returns a one-line outcome for the summary table.
"""
