"""The rank process: one per GPU (or CPU rank). Loads its shard, joins the TP group, and
executes the frontend's step plans. Never imports the HTTP stack."""
