/* dsec-agent: the supervisor (S) and start-up. One part of the agent's single translation unit (dsec-agent.c). */
/* ------------------------------------------------------------------ supervisor (S) */

static void s_msg(int type, int a, int b)
{
	struct smsg m = { type, a, b };
	send(3, &m, sizeof m, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* SIGKILL every direct child (orphans of the command's tree were reparented to us). */
static void kill_children(void)
{
	char path[64], buf[8192];
	pid_t me = getpid();
	snprintf(path, sizeof path, "/proc/%d/task/%d/children", (int)me, (int)me);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		ssize_t n = read(fd, buf, sizeof buf - 1);
		close(fd);
		if (n >= 0) {
			buf[n] = 0;
			for (char *s = buf, *end; *s; s = end) {
				long pid = strtol(s, &end, 10);
				if (end == s)
					break;
				if (pid > 0)
					kill((pid_t)pid, SIGKILL);
			}
			return;
		}
	}
	DIR *d = opendir("/proc"); /* no CONFIG_PROC_CHILDREN: scan for our children */
	if (!d)
		return;
	struct dirent *de;
	while ((de = readdir(d))) {
		long pid = atol(de->d_name);
		if (pid <= 0)
			continue;
		snprintf(path, sizeof path, "/proc/%ld/stat", pid);
		fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			continue;
		ssize_t n = read(fd, buf, sizeof buf - 1);
		close(fd);
		if (n <= 0)
			continue;
		buf[n] = 0;
		char *rp = strrchr(buf, ')'); /* comm may contain spaces and parentheses */
		long ppid;
		if (rp && sscanf(rp + 1, " %*c %ld", &ppid) == 1 && ppid == me)
			kill((pid_t)pid, SIGKILL);
	}
	closedir(d);
}

/* Kill C's process group, then every process reparented to us, until none is left. */
static void kill_tree(pid_t c, int *c_alive)
{
	if (*c_alive)
		kill(-c, SIGKILL);
	for (;;) {
		kill_children();
		int st;
		pid_t w = waitpid(-1, &st, 0);
		if (w < 0) {
			if (errno == EINTR)
				continue;
			return; /* ECHILD: nothing left */
		}
		if (w == c && *c_alive) {
			*c_alive = 0;
			s_msg(SM_STATUS, st, 0);
		}
	}
}

/* Limits of every command: RLIMIT_CORE 0, RLIMIT_NOFILE and RLIMIT_FSIZE (soft = hard, so
 * root without CAP_SYS_RESOURCE cannot raise them again). Never raises a limit. */
static int child_limits(unsigned long nofile, unsigned long long fsize)
{
	struct rlimit rl = { 0, 0 };
	if (setrlimit(RLIMIT_CORE, &rl) < 0)
		return -1;
	if (nofile && getrlimit(RLIMIT_NOFILE, &rl) == 0) {
		rlim_t n = (rlim_t)nofile < rl.rlim_max ? (rlim_t)nofile : rl.rlim_max;
		rl.rlim_cur = rl.rlim_max = n;
		if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
			return -1;
	}
	if (fsize && getrlimit(RLIMIT_FSIZE, &rl) == 0) {
		rlim_t n = (rlim_t)fsize < rl.rlim_max ? (rlim_t)fsize : rl.rlim_max;
		rl.rlim_cur = rl.rlim_max = n;
		if (setrlimit(RLIMIT_FSIZE, &rl) < 0)
			return -1;
	}
	return 0;
}

static void child_exec(uid_t uid, gid_t gid, const char *cwd, char **argv, int ep,
		       int ll_abi, unsigned long nofile, unsigned long long fsize, int pty)
{
	sigset_t none;
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	int stage = ST_SETSID;
	if (setsid() < 0)
		goto fail;
	if (pty && ioctl(0, TIOCSCTTY, 0) < 0) /* the new session's terminal: job control, ^C, SIGWINCH */
		goto fail;
	int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC); /* before Landlock: /proc */
	if (fd >= 0) {
		if (write(fd, "0", 1) < 0) { /* best effort */ }
		close(fd);
	}
	stage = ST_RLIMIT;
	if (child_limits(nofile, fsize) < 0)
		goto fail;
	stage = ST_LANDLOCK; /* fd 4: the agent's ruleset; a new domain for this command alone */
	if (ll_abi && ll_enforce(4) < 0)
		goto fail; /* the agent saw Landlock working: fail closed */
	if (ll_abi)
		close(4);
	if (geteuid() == 0) {
		stage = ST_SETGROUPS;
		if (setgroups(0, NULL) < 0)
			goto fail;
		stage = ST_SETGID;
		if (setgid(gid) < 0)
			goto fail;
		stage = ST_SETUID;
		if (setuid(uid) < 0)
			goto fail;
	} else if (uid != geteuid() || gid != getegid()) {
		stage = ST_SETUID;
		errno = EPERM;
		goto fail;
	}
	stage = ST_CHDIR;
	if (chdir(cwd) < 0)
		goto fail;
	stage = ST_EXEC;
	execve(argv[0], argv, environ);
fail:;
	int m[2] = { errno, stage };
	if (write(ep, m, sizeof m) < 0) { /* nothing left to do */ }
	_exit(127);
}

/* argv: self --supervise UID GID CWD AGENT_PID LL_ABI:NOFILE:FSIZE:PTY cmd... ;
 * fds 0-2 for C (PTY 1: a terminal's slave side, made C's controlling tty), 3 = control socket. */
static int supervise_main(int argc, char **argv)
{
	if (argc < 8)
		return 2;
	uid_t uid = (uid_t)strtoul(argv[2], NULL, 10);
	gid_t gid = (gid_t)strtoul(argv[3], NULL, 10);
	const char *cwd = argv[4];
	pid_t agent = (pid_t)atoi(argv[5]);
	int ll_abi = 0;
	unsigned long nofile = 0;
	unsigned long long fsize = 0;
	int pty = 0;
	if (sscanf(argv[6], "%d:%lu:%llu:%d", &ll_abi, &nofile, &fsize, &pty) != 4)
		return 2;
	char **cargv = argv + 7;

	prctl(PR_SET_DUMPABLE, 0); /* like the agent: no ptrace, no /proc/PID/{fd,mem} from commands */

	fcntl(3, F_SETFD, FD_CLOEXEC); /* C must never see the control socket */
	cloexec_from3();
	sigset_t ss;
	sigemptyset(&ss);
	sigaddset(&ss, SIGCHLD);
	sigaddset(&ss, SIGTERM);
	sigprocmask(SIG_BLOCK, &ss, NULL);
	int sfd = signalfd(-1, &ss, SFD_CLOEXEC | SFD_NONBLOCK);
	prctl(PR_SET_CHILD_SUBREAPER, 1);
	prctl(PR_SET_PDEATHSIG, SIGTERM); /* agent gone: take the tree down with us */
	if (getppid() != agent)
		return 1;
	int ep[2];
	if (sfd < 0 || pipe2(ep, O_CLOEXEC) < 0) {
		s_msg(SM_PID, -errno, 0);
		return 1;
	}
	pid_t c = fork();
	if (c == 0)
		child_exec(uid, gid, cwd, cargv, ep[1], ll_abi, nofile, fsize, pty);
	s_msg(SM_PID, c < 0 ? -errno : c, 0);
	if (c < 0)
		return 1;
	close(ep[1]);
	if (ll_abi)
		close(4); /* only C needed the ruleset */
	/* drop our copies of C's stdio so EOF depends on C's tree only */
	int nul = open("/dev/null", O_RDWR | O_CLOEXEC);
	for (int i = 0; i < 3; i++)
		if (nul < 0 || dup3(nul, i, 0) < 0)
			close(i);
	int m[2];
	ssize_t r;
	while ((r = read(ep[0], m, sizeof m)) < 0 && errno == EINTR)
		;
	if (r == (ssize_t)sizeof m)
		s_msg(SM_STARTERR, m[0], m[1]);
	close(ep[0]);

	int c_alive = 1, ctl_open = 1;
	for (;;) {
		struct pollfd pf[2] = { { sfd, POLLIN, 0 }, { ctl_open ? 3 : -1, POLLIN, 0 } };
		if (poll(pf, 2, -1) < 0 && errno != EINTR)
			return 1;
		if (pf[1].revents) {
			char b[16];
			ssize_t n = recv(3, b, sizeof b, MSG_DONTWAIT);
			if (n > 0) { /* kill request */
				kill_tree(c, &c_alive);
				return 0;
			}
			if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
				ctl_open = 0; /* the agent is done with us; keep reaping the background */
				close(3);
			}
		}
		if (pf[0].revents) {
			struct signalfd_siginfo si;
			int term = 0;
			while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si)
				term |= si.ssi_signo == SIGTERM;
			if (term) {
				kill_tree(c, &c_alive);
				return 0;
			}
		}
		for (;;) {
			int st;
			pid_t w = waitpid(-1, &st, WNOHANG);
			if (w > 0) {
				if (w == c && c_alive) {
					c_alive = 0;
					s_msg(SM_STATUS, st, 0);
				}
				continue;
			}
			if (w < 0 && errno == ECHILD)
				return 0; /* C and all its leftovers are gone */
			break;
		}
	}
}

/* ------------------------------------------------------------------ start-up */

static void usage(void)
{
	fputs("usage: dsec-agent [-w WORKDIR] [-u UID] [-g GID] [-f LISTEN_FD | -D DEVICE] [-s SHELL]\n"
	      "                  [-L 0|1] [-n NOFILE] [-F FSIZE_BYTES] [-R RETAIN_BYTES]\n", stderr);
	exit(2);
}

int main(int argc, char **argv)
{
	if (argc > 1 && !strcmp(argv[1], "--supervise"))
		return supervise_main(argc, argv);
	int opt;
	while ((opt = getopt(argc, argv, "w:u:g:f:s:L:n:F:D:R:")) != -1) {
		switch (opt) {
		case 'w': G.workdir = optarg; break;
		case 'u': G.uid = (uid_t)strtoul(optarg, NULL, 10); break;
		case 'g': G.gid = (gid_t)strtoul(optarg, NULL, 10); break;
		case 'f': G.lfd = atoi(optarg); break;
		case 's': G.shell = optarg; break;
		case 'L': G.ll_abi = atoi(optarg) ? -1 : 0; break;
		case 'n': G.nofile = strtoul(optarg, NULL, 10); break;
		case 'F': G.fsize = strtoull(optarg, NULL, 10); break;
		case 'D': G.dev = optarg; break;
		case 'R': G.retain_max = (size_t)strtoull(optarg, NULL, 10); break;
		default: usage();
		}
	}
	if (G.workdir[0] != '/' || strlen(G.workdir) >= PATH_MAX - 64)
		usage();
	umask(022);
	/* Nothing in the sandbox may ptrace us or open /proc/1/{fd,environ,mem} (our own stderr
	 * is the host's init log, fd 3 the edge's socket): without CAP_SYS_PTRACE, which no
	 * sandbox process has, a non-dumpable process is off limits even to root. */
	prctl(PR_SET_DUMPABLE, 0);
	/* Device mode (a VM guest, where root has every capability): no command may do port
	 * I/O (iopl/ioperm, /dev/port: CAP_SYS_RAWIO 17; its writes to the serial port bypass
	 * Landlock) nor load a module that would (CAP_SYS_MODULE 16). Out of the bounding set,
	 * no exec regains them. A container's runtime never grants them in the first place. */
	if (G.dev && (prctl(PR_CAPBSET_DROP, 17, 0, 0, 0) < 0 || prctl(PR_CAPBSET_DROP, 16, 0, 0, 0) < 0)) {
		perror("dsec-agent: PR_CAPBSET_DROP");
		return 1;
	}
	if (G.ll_abi) {
		int abi = ll_probe();
		G.ll_abi = abi >= LL_MIN_ABI ? abi : 0;
		if (!G.ll_abi) /* logged once; seccomp, capabilities, mounts still apply */
			fprintf(stderr, "dsec-agent: Landlock %s: commands run without it\n",
				abi ? "ABI 1 is too old (need 2)" : "is not available");
	}
	for (int i = 0; i < 3; i++) /* pipes must never land on 0..2 */
		if (fcntl(i, F_GETFD) < 0 && open("/dev/null", O_RDWR) < 0)
			_exit(1);
	int listening = 0;
	socklen_t sl = sizeof listening;
	if (G.dev) {
		G.lfd = -1; /* the port is the one connection; no listener */
	} else if (getsockopt(G.lfd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &sl) < 0 || !listening) {
		fprintf(stderr, "dsec-agent: fd %d is not a listening socket\n", G.lfd);
		return 1;
	}
	cloexec_from3(); /* nothing the agent inherited may leak into commands */
	if (G.lfd >= 0)
		set_nonblock(G.lfd);
	signal(SIGPIPE, SIG_IGN);
	sigset_t ss;
	sigemptyset(&ss);
	sigaddset(&ss, SIGCHLD);
	sigaddset(&ss, SIGTERM);
	sigaddset(&ss, SIGINT);
	if (G.dev)
		sigaddset(&ss, SIGIO); /* O_ASYNC on the port: the host side (re)connected */
	sigprocmask(SIG_BLOCK, &ss, NULL);
	G.sfd = signalfd(-1, &ss, SFD_CLOEXEC | SFD_NONBLOCK);
	if (G.sfd < 0) {
		perror("dsec-agent: signalfd");
		return 1;
	}
	if (G.dev) {
		G.dfd = open(G.dev, O_RDWR | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
		if (G.dfd < 0) {
			fprintf(stderr, "dsec-agent: open %s: %s\n", G.dev, strerror(errno));
			return 1;
		}
		fcntl(G.dfd, F_SETOWN, getpid());
		dev_detach(DS_AWAY); /* probe at once: the host may already be connected */
	}
	if (getpid() != 1) {
		prctl(PR_SET_CHILD_SUBREAPER, 1); /* orphans come to us as they would to PID 1 */
	} else {
		int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
		if (fd >= 0) { /* the OOM killer should pick a command, not the sandbox's init */
			if (write(fd, "-1000", 5) < 0) { /* best effort */ }
			close(fd);
		}
	}
	if (setgroups(0, NULL) < 0 && errno != EPERM)
		perror("dsec-agent: setgroups");
	struct stat st;
	if (stat(G.workdir, &st) < 0) {
		char wd[PATH_MAX];
		int created = 0;
		snprintf(wd, sizeof wd, "%s", G.workdir);
		size_t n = strlen(wd);
		while (n > 1 && wd[n - 1] == '/')
			wd[--n] = 0;
		int err = mkdirs(wd, n, 0755, &created);
		if (err)
			fprintf(stderr, "dsec-agent: mkdir %s: %s\n", wd, strerror(err));
		else if (created && (chown(wd, G.uid, G.gid) < 0 || chmod(wd, 0755) < 0))
			perror("dsec-agent: chown workdir");
	}
	if (chdir("/") < 0) { /* hold no directory busy */ }
	/* supervisors are this binary re-executed: exactly this file, even if replaced on disk */
	G.self = "/proc/self/exe";
	G.self_alt = argv[0][0] == '/' ? argv[0] : NULL;
	loop();
	return 0;
}
