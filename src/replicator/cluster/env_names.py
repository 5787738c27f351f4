"""The names the launcher and its workers agree on (variables, store keys, an exit code), here
so that worker-side code never imports the launcher."""

from __future__ import annotations

#: Exit code of a worker that got SIGTERM, agreed on a step and saved a backup (``EX_TEMPFAIL``,
#: "retry", so a scheduler tells preemption from a crash); the launcher's for a preempted job.
PREEMPTION_EXIT_CODE = 75

#: Which launcher started this process ("local", "multi-node").
LAUNCHER_ENV = "REPLICATOR_LAUNCHER"
#: "1" when the launcher already hosts the rendezvous store (rank 0 connects as a client).
STORE_HOSTED_ENV = "REPLICATOR_STORE_HOSTED"
#: How many times the launcher has restarted the job (0 on the first attempt).
RESTART_COUNT_ENV = "REPLICATOR_RESTART_COUNT"
#: Seconds a collective or a rendezvous may wait (``--timeout``).
TIMEOUT_ENV = "REPLICATOR_TIMEOUT_SECONDS"
#: Directory where a failing worker writes its traceback for the launcher to report.
ERROR_DIR_ENV = "REPLICATOR_ERROR_DIR"
#: Seconds preempted workers get to save their backup and exit.
PREEMPTION_GRACE_ENV = "REPLICATOR_PREEMPTION_GRACE_SECONDS"
#: How many of the job's processes (the last ranks) are parameter servers (``--num-ps``).
NUM_PS_ENV = "REPLICATOR_NUM_PS"
#: Set to "1" for a worker restarted alone to rejoin running parameter servers.
REJOIN_ENV = "REPLICATOR_REJOIN"
#: Set to "0" to keep parameter-server payloads on the socket between processes of one host.
PS_SHARED_MEMORY_ENV = "REPLICATOR_PS_SHARED_MEMORY"
#: A name for this host that overrides the detected one (hosts are grouped by it).
HOST_ENV = "REPLICATOR_HOST"
#: The rendezvous id of a multi-node job (default: derived from the port).
RUN_ID_ENV = "REPLICATOR_RUN_ID"
#: Directory for shared-memory segments (default ``/dev/shm``).
SHM_DIR_ENV = "REPLICATOR_SHM_DIR"
#: This process's replica group, 0..N-1 (``--replica-groups N``: live recovery over torchft).
REPLICA_GROUP_ENV = "REPLICATOR_REPLICA_GROUP"
#: How many replica groups the job was started with (``--replica-groups``).
REPLICA_GROUPS_ENV = "REPLICATOR_REPLICA_GROUPS"
#: The torchft lighthouse every group joins, as ``http://HOST:PORT``.
LIGHTHOUSE_ENV = "REPLICATOR_LIGHTHOUSE"
#: Fewest replica groups a step may commit with (``--min-replicas``); fewer and the job waits.
MIN_REPLICAS_ENV = "REPLICATOR_MIN_REPLICAS"
#: The address a replica group's store, torchft manager and state server listen on, which the
#: other groups reach it at: ``127.0.0.1`` when the lighthouse is on loopback, else this
#: host's address on the network towards the lighthouse.
LIVE_BIND_ENV = "REPLICATOR_LIVE_BIND"
#: The replica id a group gives torchft's Manager (torchft appends ``:<uuid>``); the launcher
#: reads the ids a lighthouse has seen to give a joining group (``--join``) an unused one.
REPLICA_ID_FORMAT = "replicator_group_{group}"

#: How many actor processes the job runs beside its learners (``--num-actors``).
NUM_ACTORS_ENV = "REPLICATOR_NUM_ACTORS"
#: This process's actor index, 0..A-1 (set only in actor processes).
ACTOR_INDEX_ENV = "REPLICATOR_ACTOR_INDEX"
#: How many learner replicas an actor's job has (actors are not ranks of the learners' group).
NUM_LEARNERS_ENV = "REPLICATOR_NUM_LEARNERS"
#: ``host:port`` of the launcher's store, for actors (which hold no rank, so no MASTER_ADDR).
RL_STORE_ENV = "REPLICATOR_RL_STORE"

#: Store key (under the attempt's prefix) that says worker rank R is being restarted alone.
REJOIN_KEY = "ps/rejoining/{rank}"

#: How a parameter-server job's processes are scheduled on their cores: "auto" (batch when they
#: outnumber the cores), "batch" or "default" (:mod:`replicator.cluster.cpu_scheduling`).
CPU_SCHEDULING_ENV = "REPLICATOR_CPU_SCHEDULING"
#: "default" keeps glibc's malloc thresholds in the launcher's workers ("auto": raised).
MALLOC_ENV = "REPLICATOR_MALLOC"
