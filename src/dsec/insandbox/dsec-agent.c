/*
 * dsec-agent: the in-sandbox agent, PID 1 of every container sandbox.
 *
 * Contract: docs/agent-protocol.md. In short: one AF_UNIX connection at a time (a new one
 * replaces the old), length-prefixed frames, commands run through `shell -c`, persistent
 * shell sessions, and file operations done with the sandbox user's filesystem ids.
 *
 * Design:
 *  - Single-threaded poll() loop over the listening socket, the edge connection, a signalfd
 *    (SIGCHLD, SIGTERM, SIGINT) and the fds of every running command. Timers come from the
 *    nearest deadline; nothing in the loop blocks on untrusted parties.
 *  - Every command runs under a supervisor S: this same binary re-executed with
 *    `--supervise` (a fresh, tiny image rather than a fork of the agent, so a long-lived S
 *    does not pin the agent's heap). S is a child subreaper, so everything the command
 *    starts (even after setsid()) stays below S and a timeout can kill the whole tree.
 *    S reports the command's pid, start-up errors and wait status over a SEQPACKET socket.
 *  - Bounded memory everywhere: frame size, per-stream output caps, a retained-exec limit
 *    (count and bytes), a paced outgoing queue (dropped beyond OUTQ_DROP), bounded stdin
 *    queues, bounded listings.
 *  - Malformed input never crashes the agent: a bad frame is answered with ERROR, an
 *    unparseable stream (oversize length) drops the connection.
 *
 * Layout: this file is the agent's one translation unit (every function stays static, and -Os
 * sees the whole program); its parts live in agent/, included below in this order.
 * agent/protocol.h is generated from src/dsec/agent/protocol.py (python -m dsec.agent.gen_header).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#include "agent/base.c"
#include "agent/output.c"
#include "agent/procs.c"
#include "agent/exec.c"
#include "agent/files.c"
#include "agent/watches.c"
#include "agent/loop.c"
#include "agent/startup.c"
