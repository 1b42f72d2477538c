"""Where work runs: a rollout, a grade, a review or a gate runs here, in this process and this host's
store, or as a Run Store job that a worker on some host claims. The callers (evaluation, the RL driver,
the worker) pass the same requests and get the same records either way.

* ``payloads``: the typed payload of each job kind, and the kinds a Run Store is told to accept;
* ``endpoints``: how a job names a model endpoint (a worker's configured name, or a plain URL), never a key;
* ``local``: the work itself, run here (what a worker's handlers and in-process callers both call);
* ``remote``: the same work as Run Store jobs, submitted and waited on;
* ``journals``: removing what a rollout left (its journal, sandbox and checkpoints).
"""
