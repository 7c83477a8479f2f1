"""dsec's durable control state, as numbered migrations (both engines run the same text).

Append a migration to change the schema; never edit one that has shipped. Migration 1 is the
schema the SQLite-only IAM created (IF NOT EXISTS: an iam.db from before this layer adopts it
unchanged). Types: BIGINT where values pass 2^31 (the root's memory quota), DOUBLE PRECISION
for times (epoch seconds) and cores, INTEGER 0/1 for booleans.
"""

from __future__ import annotations

MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (1, "projects, api keys, project policies", [
        """CREATE TABLE IF NOT EXISTS projects (
            id            TEXT PRIMARY KEY,
            name          TEXT NOT NULL,
            parent_id     TEXT REFERENCES projects(id) ON DELETE RESTRICT,
            max_sandboxes BIGINT NOT NULL CHECK (max_sandboxes >= 0),
            max_cpu_cores DOUBLE PRECISION NOT NULL CHECK (max_cpu_cores >= 0),
            max_memory_mb BIGINT NOT NULL CHECK (max_memory_mb >= 0),
            created_at    DOUBLE PRECISION NOT NULL,
            UNIQUE (parent_id, name)
        )""",
        # UNIQUE(parent_id, name) does not cover NULL parents: top-level names get their own index
        "CREATE UNIQUE INDEX IF NOT EXISTS projects_top_name ON projects(name) WHERE parent_id IS NULL",
        "CREATE INDEX IF NOT EXISTS projects_parent ON projects(parent_id)",
        """CREATE TABLE IF NOT EXISTS api_keys (
            id         TEXT PRIMARY KEY,
            project_id TEXT NOT NULL REFERENCES projects(id) ON DELETE CASCADE,
            prefix     TEXT NOT NULL,
            hash       TEXT NOT NULL UNIQUE,
            created_at DOUBLE PRECISION NOT NULL,
            revoked    INTEGER NOT NULL DEFAULT 0
        )""",
        "CREATE INDEX IF NOT EXISTS api_keys_project ON api_keys(project_id)",
        """CREATE TABLE IF NOT EXISTS project_policies (
            project_id TEXT PRIMARY KEY REFERENCES projects(id) ON DELETE CASCADE,
            policy     TEXT NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        )""",
    ]),
    (2, "quota ledger, cross-node sandbox index", [
        # what a project and everything below it holds now (kept with the ledger, one transaction)
        """CREATE TABLE quota_usage (
            project_id TEXT PRIMARY KEY REFERENCES projects(id) ON DELETE CASCADE,
            sandboxes  BIGINT NOT NULL DEFAULT 0,
            cpu_millis BIGINT NOT NULL DEFAULT 0,
            memory_mb  BIGINT NOT NULL DEFAULT 0
        )""",
        # one row per sandbox holding quota: reserved before creation, bound to the sandbox id
        # once the edge created it, deleted when it ends
        """CREATE TABLE quota_reservations (
            id           TEXT PRIMARY KEY,
            project_id   TEXT NOT NULL REFERENCES projects(id) ON DELETE RESTRICT,
            sandbox_id   TEXT UNIQUE,
            cpu_millis   BIGINT NOT NULL,
            memory_mb    BIGINT NOT NULL,
            created_at   DOUBLE PRECISION NOT NULL,
            activated_at DOUBLE PRECISION
        )""",
        "CREATE INDEX quota_reservations_project ON quota_reservations(project_id)",
        "INSERT INTO quota_usage (project_id) SELECT id FROM projects",   # projects made before v2
        # every sandbox of the cluster, by project: listing without asking every edge
        """CREATE TABLE sandbox_index (
            id         TEXT PRIMARY KEY,
            node       TEXT NOT NULL,
            project_id TEXT NOT NULL,
            labels     TEXT NOT NULL DEFAULT '{}',
            state      TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL,
            ended_at   DOUBLE PRECISION
        )""",
        "CREATE INDEX sandbox_index_project ON sandbox_index(project_id, ended_at)",
        "CREATE INDEX sandbox_index_node ON sandbox_index(node, ended_at)",
    ]),
    (3, "sandbox index info, idempotency claims", [
        # the SandboxInfo last seen (JSON): what listing shows for a node that does not answer
        "ALTER TABLE sandbox_index ADD COLUMN info TEXT",
        # a create's idempotency key, claimed cluster-wide before placement (D38): a retry that
        # lands on another replica or node returns the sandbox the first made (sandbox_id set),
        # or waits while it is still being made (sandbox_id NULL)
        """CREATE TABLE idempotency_claims (
            project_id TEXT NOT NULL,
            key        TEXT NOT NULL,
            sandbox_id TEXT,
            claim      TEXT NOT NULL,
            claimed_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (project_id, key)
        )""",
        "CREATE INDEX idempotency_claims_at ON idempotency_claims(claimed_at)",
    ]),
    (4, "key rotation: a rotated key's end of grace", [
        # epoch seconds after which the key no longer authenticates; NULL: until revoked
        "ALTER TABLE api_keys ADD COLUMN expires_at DOUBLE PRECISION",
    ]),
    (5, "cluster nodes: identity, subnet, operator state, absence", [
        # one row per node name (cluster/names.py, store/nodes.py): its edge's subnet (kept across
        # restarts: adopted sandboxes keep their addresses), what the operator set (active,
        # cordoned, draining), and since when discovery has missed it (the durable lost timer)
        """CREATE TABLE cluster_nodes (
            node          TEXT PRIMARY KEY,
            state         TEXT NOT NULL DEFAULT 'active',
            subnet        TEXT,
            missing_since DOUBLE PRECISION,
            updated_at    DOUBLE PRECISION NOT NULL
        )""",
        "CREATE UNIQUE INDEX cluster_nodes_subnet ON cluster_nodes(subnet)",
    ]),
    (6, "operators' named network rule sets", [
        # body: NetworkRuleSet as JSON ({"rules": [...], "domains": [...]})
        """CREATE TABLE network_rulesets (
            name       TEXT PRIMARY KEY,
            body       TEXT NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        )""",
    ]),
    (7, "secrets added at the egress proxy", [
        # value_enc: Fernet token under the operator's key file (iam/secrets.py), never returned
        """CREATE TABLE egress_secrets (
            id         TEXT PRIMARY KEY,
            project_id TEXT NOT NULL REFERENCES projects(id) ON DELETE CASCADE,
            name       TEXT NOT NULL,
            hosts      TEXT NOT NULL,
            ports      TEXT NOT NULL,
            header     TEXT,
            basic_auth INTEGER NOT NULL DEFAULT 0,
            value_enc  TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            UNIQUE (project_id, name)
        )""",
    ]),
    (8, "lifecycle events, webhooks, their deliveries", [
        # ids come from events_head's one row, bumped in the ingesting transaction: the row lock
        # orders the ingests, so ids commit in order and a stream resumed after an id misses none
        "CREATE TABLE events_head (k INTEGER PRIMARY KEY, last_id BIGINT NOT NULL)",
        "INSERT INTO events_head (k, last_id) VALUES (1, 0)",
        """CREATE TABLE events (
            id         BIGINT PRIMARY KEY,
            source     TEXT NOT NULL,
            seq        BIGINT NOT NULL,
            type       TEXT NOT NULL,
            sandbox_id TEXT NOT NULL,
            project_id TEXT NOT NULL,
            node       TEXT NOT NULL,
            reason     TEXT,
            message    TEXT,
            at         DOUBLE PRECISION NOT NULL,
            details    TEXT NOT NULL DEFAULT '{}'
        )""",
        "CREATE INDEX events_project ON events(project_id, id)",
        "CREATE INDEX events_sandbox ON events(sandbox_id, id)",
        "CREATE INDEX events_at ON events(at)",
        # how far each source (an edge's node id) has been ingested
        "CREATE TABLE event_cursors (source TEXT PRIMARY KEY, seq BIGINT NOT NULL)",
        """CREATE TABLE webhooks (
            id         TEXT PRIMARY KEY,
            project_id TEXT NOT NULL REFERENCES projects(id) ON DELETE CASCADE,
            url        TEXT NOT NULL,
            name       TEXT NOT NULL DEFAULT '',
            events     TEXT,
            secret     TEXT NOT NULL,
            scheme     TEXT NOT NULL,
            enabled    INTEGER NOT NULL DEFAULT 1,
            private_ok INTEGER NOT NULL DEFAULT 0,
            created_at DOUBLE PRECISION NOT NULL
        )""",
        "CREATE INDEX webhooks_project ON webhooks(project_id)",
        # one row per (webhook, event): queued with the event, sent until delivered or given up
        """CREATE TABLE webhook_deliveries (
            id           TEXT PRIMARY KEY,
            webhook_id   TEXT NOT NULL REFERENCES webhooks(id) ON DELETE CASCADE,
            event_id     BIGINT NOT NULL,
            status       TEXT NOT NULL,
            attempts     INTEGER NOT NULL DEFAULT 0,
            next_at      DOUBLE PRECISION NOT NULL,
            lease_until  DOUBLE PRECISION NOT NULL DEFAULT 0,
            last_status  INTEGER,
            last_error   TEXT,
            created_at   DOUBLE PRECISION NOT NULL,
            delivered_at DOUBLE PRECISION
        )""",
        "CREATE INDEX webhook_deliveries_due ON webhook_deliveries(status, next_at)",
        "CREATE INDEX webhook_deliveries_hook ON webhook_deliveries(webhook_id, created_at)",
    ]),
    (9, "audit log; API key roles", [
        # who (which key) did what to what; ids sort by time (store/audit.py), so a page resumes
        # after the last id it saw; no secret values, command text or file contents
        """CREATE TABLE audit_log (
            id         TEXT PRIMARY KEY,
            at         DOUBLE PRECISION NOT NULL,
            project_id TEXT NOT NULL,
            key_id     TEXT NOT NULL,
            action     TEXT NOT NULL,
            target     TEXT NOT NULL DEFAULT '',
            status     INTEGER NOT NULL,
            details    TEXT NOT NULL DEFAULT '{}'
        )""",
        "CREATE INDEX audit_log_project ON audit_log(project_id, id)",
        "CREATE INDEX audit_log_at ON audit_log(at)",
        # admin: manages its project's keys and reads its audit log; member: uses sandboxes only
        "ALTER TABLE api_keys ADD COLUMN role TEXT NOT NULL DEFAULT 'admin'",
    ]),
]

LATEST = MIGRATIONS[-1][0]
