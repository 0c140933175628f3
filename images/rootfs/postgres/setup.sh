#!/usr/bin/env bash
# Runs inside the `postgres` image's tree (chroot) after its packages:
# shapes the cluster Debian's postgresql-15 creates (15/main, port 5432)
# for a 512 MiB VM, makes the `clade` role and database, and installs the
# hooks that start the server: /etc/clade/bake (run by the template's
# bake, so that every sandbox is restored with the server running) and
# /etc/clade/start (the same, for a guest booted from its disk).
set -euo pipefail
version=15 cluster=main
conf_dir=/etc/postgresql/$version/$cluster
data_dir=/var/lib/postgresql/$version/$cluster
wal_archive=/var/lib/postgresql/wal-archive
bin=/usr/lib/postgresql/$version/bin

# The cluster the package made takes its locale from the build's
# environment: made again, the same on every host (UTF-8, C collation
# that no glibc upgrade reorders, page checksums). --stop also stops it
# if the package's scripts started it in this chroot.
if [ -d "$conf_dir" ]; then
  pg_dropcluster --stop "$version" "$cluster"
fi
pg_createcluster --port 5432 --locale C.UTF-8 --encoding UTF8 "$version" "$cluster" -- --data-checksums

install -d -o postgres -g postgres -m 0700 "$wal_archive"

# Debian's postgresql.conf includes conf.d/; what Clade sets is in one file
# of its own there, and overrides Debian's lines.
cat > "$conf_dir/conf.d/clade.conf" <<CONF
# Clade's postgres image (images/rootfs/postgres/setup.sh).
listen_addresses = '*'
port = 5432
password_encryption = scram-sha-256

# Memory for a 512 MiB VM: the server's shared memory, its sessions' work
# areas and the guest's page cache share it.
max_connections = 50
shared_buffers = 64MB
huge_pages = off
# initdb picks by what the build host offers; the guest has /dev/shm.
dynamic_shared_memory_type = posix
# No LLVM compiles of costly queries: memory and CPU a small VM (and
# software emulation) cannot spare.
jit = off
work_mem = 2MB
maintenance_work_mem = 32MB
effective_cache_size = 192MB
max_wal_size = 256MB
min_wal_size = 64MB

# WAL kept for point-in-time recovery: every finished segment is copied
# to $wal_archive, never over one that is there.
wal_level = replica
archive_mode = on
archive_command = 'test ! -f $wal_archive/%f && cp %p $wal_archive/%f'
CONF
chown postgres:postgres "$conf_dir/conf.d/clade.conf"

# Passwords (SCRAM) over TCP from anywhere; the postgres OS user by peer
# on the local socket (how Clade, inside the guest, administers it).
cat > "$conf_dir/pg_hba.conf" <<'HBA'
# TYPE  DATABASE     USER      ADDRESS     METHOD
local   all          postgres              peer
local   replication  postgres              peer
local   all          all                   scram-sha-256
host    all          all       0.0.0.0/0   scram-sha-256
host    all          all       ::/0        scram-sha-256
host    replication  all       0.0.0.0/0   scram-sha-256
host    replication  all       ::/0        scram-sha-256
HBA
chown postgres:postgres "$conf_dir/pg_hba.conf"
chmod 0640 "$conf_dir/pg_hba.conf"

# The role and its database, in single-user mode: no server is started in
# the chroot, so nothing listens on the build host's port 5432 and nothing
# is left running. No password: the template must hold no usable one (each
# database gets its own, set after the restore). FILE_COPY: the copy of
# template1 is not written to the WAL as well (8 MB less in the image).
# (The chroot's /dev/shm is no tmpfs: dynamic shared memory in files here.)
single_user() {
  runuser -u postgres -- "$bin/postgres" --single -D "$data_dir" -c "config_file=$conf_dir/postgresql.conf" \
    -c dynamic_shared_memory_type=mmap "$@" 2>&1
}
# Single-user mode reports a failed statement and carries on: its output says.
if ! created=$(single_user postgres <<'SQL'
CREATE ROLE clade LOGIN NOSUPERUSER CREATEDB CREATEROLE NOREPLICATION PASSWORD NULL;
CREATE DATABASE clade OWNER clade STRATEGY FILE_COPY;
SQL
) || grep -qE 'ERROR|FATAL|PANIC' <<<"$created"; then
  echo "$created" >&2
  exit 1
fi
roles=$(single_user clade <<<"SELECT rolname, rolsuper, rolpassword IS NULL AS no_password FROM pg_authid WHERE rolname = 'clade';") || true
if ! grep -q 'rolsuper = "f"' <<<"$roles" || ! grep -q 'no_password = "t"' <<<"$roles"; then
  echo "the role clade is not as it should be: $roles" >&2
  exit 1
fi

install -d -m 0755 /etc/clade
cat > /etc/clade/start <<START
#!/bin/sh
# Starts the image's PostgreSQL $version cluster ($version/$cluster, port 5432)
# unless it runs, and waits until it accepts connections (at most 60 s).
# Exits non-zero with the end of the server's log otherwise.
set -u
log=/var/log/postgresql/postgresql-$version-$cluster.log
fail() {
  echo "\$1; the end of \$log:" >&2
  tail -n 40 "\$log" 2>/dev/null >&2
  exit 1
}
# /run is a tmpfs the agent mounts at boot, and the image's build empties /var/log.
install -d -o postgres -g postgres -m 2775 /run/postgresql
install -d -o root -g postgres -m 1775 /var/log/postgresql
if ! pg_ctlcluster $version $cluster status >/dev/null 2>&1; then
  pg_ctlcluster $version $cluster start || fail "PostgreSQL $version did not start"
fi
deadline=\$((\$(date +%s) + 60))
until pg_isready -q -h /run/postgresql -p 5432; do
  [ "\$(date +%s)" -lt "\$deadline" ] || fail "PostgreSQL $version did not accept connections within 60 s"
  sleep 0.2
done
START
cat > /etc/clade/bake <<'BAKE'
#!/bin/sh
# Run by Clade's template bake (after its warm-up, before the snapshot):
# every sandbox of this image is restored with the server running.
set -eu
/etc/clade/start
# What a first connection reads (the catalogs) in the template's memory;
# then a checkpoint, so that no sandbox inherits dirty buffers to write.
runuser -u postgres -- psql -X -q -d clade -c 'SELECT count(*) FROM pg_class' >/dev/null
runuser -u postgres -- psql -X -q -c 'CHECKPOINT'
BAKE
chmod 0755 /etc/clade/start /etc/clade/bake

# Nothing of the build's may be running; the guest's /run is a tmpfs.
if pg_ctlcluster "$version" "$cluster" status >/dev/null 2>&1; then
  echo "a PostgreSQL server is running in the tree" >&2
  exit 1
fi
rm -rf /run/postgresql
psql --version
