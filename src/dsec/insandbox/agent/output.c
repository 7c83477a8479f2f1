/* dsec-agent: the paced outgoing queue and what execs retain and send. One part of the agent's single translation unit (dsec-agent.c). */
/* ------------------------------------------------------------------ connection output */

/* Device mode: the port stays open; SIGIO (O_ASYNC) tells us when the host side reconnects. */
static void dev_detach(int state)
{
	G.dstate = state;
	G.dev_retry = 0;
	G.dev_backoff = 1;
	fcntl(G.dfd, F_SETFL, fcntl(G.dfd, F_GETFL) | O_ASYNC);
}

static void conn_close(void)
{
	if (G.conn < 0)
		return;
	if (G.conn == G.dfd) /* EOF: the host left; otherwise we dropped it: discard until it leaves */
		dev_detach(G.dev_eof ? DS_AWAY : DS_DRAIN);
	else
		close(G.conn);
	G.dev_eof = 0;
	G.conn = -1;
	G.gen++;                  /* detaches every exec and file reader */
	bq_free(&G.out);
	if (!G.dispatching)       /* frame handlers may still point into the input buffer */
		bq_free(&G.in);
}

static void put_hdr(uint8_t *w, uint32_t len, int type, uint32_t chan)
{
	put32(w, len);
	w[4] = (uint8_t)type;
	w[5] = 0;
	put16(w + 6, 0);
	put32(w + 8, chan);
}

static int out_frame(int type, uint32_t chan, const void *a, size_t alen, const void *b, size_t blen)
{
	if (G.conn < 0)
		return -1;
	if (G.out.len > OUTQ_DROP) { /* the edge stopped reading; it can re-ATTACH later */
		conn_close();
		return -1;
	}
	if (bq_reserve(&G.out, HDR + alen + blen) < 0) {
		conn_close();
		return -1;
	}
	uint8_t *w = (uint8_t *)G.out.p + G.out.off + G.out.len;
	put_hdr(w, (uint32_t)(alen + blen), type, chan);
	if (alen)
		memcpy(w + HDR, a, alen);
	if (blen)
		memcpy(w + HDR + alen, b, blen);
	G.out.len += HDR + alen + blen;
	return 0;
}

static void send_err(uint32_t chan, int err, const char *fmt, ...)
{
	char msg[600];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	if (n < 0)
		n = 0;
	if ((size_t)n >= sizeof msg)
		n = sizeof msg - 1;
	uint8_t e[4];
	put32(e, (uint32_t)err);
	out_frame(T_ERROR, chan, e, 4, msg, (size_t)n);
}

static void send_ok(uint32_t chan) { out_frame(T_OK, chan, NULL, 0, NULL, 0); }

static void conn_flush(void)
{
	while (G.conn >= 0 && G.out.len) {
		ssize_t n = G.conn == G.dfd ? write(G.conn, G.out.p + G.out.off, G.out.len)
			: send(G.conn, G.out.p + G.out.off, G.out.len, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (n > 0) {
			bq_consume(&G.out, (size_t)n);
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			break;
		conn_close();
		return;
	}
	bq_trim(&G.out);
}

/* ------------------------------------------------------------------ execs: output & retention */

static int attached(const struct exec *e) { return G.conn >= 0 && e->gen == G.gen; }

static struct exec *exec_find(uint32_t chan)
{
	for (struct exec *e = G.execs; e; e = e->next)
		if (e->chan == chan)
			return e;
	return NULL;
}

static void free_strv(char **v)
{
	free(v); /* pointer array and strings are one allocation */
}

static void exec_free(struct exec *e)
{
	for (struct exec **pp = &G.execs; *pp; pp = &(*pp)->next)
		if (*pp == e) {
			*pp = e->next;
			break;
		}
	for (int i = 0; i < 2; i++) {
		rbuf_free(&e->out[i]);
		rbuf_free(&e->chk[i]);
	}
	free(e->cwd);
	free(e->script);
	free_strv(e->env);
	free(e);
}

/* Output of a running exec: counted always, retained and forwarded up to CAP. */
static void exec_output(struct exec *e, int st, const char *d, size_t n)
{
	e->total[st] += n;
	if (e->pty && e->sent[st]) { /* a terminal runs for long: keep only what is not sent yet */
		struct rbuf *r = &e->out[st];
		memmove(r->p, r->p + e->sent[st], r->len - e->sent[st]);
		r->len -= e->sent[st];
		e->sent[st] = 0;
	}
	if (rbuf_add(&e->out[st], d, n, e->cap) < n)
		e->truncated = 1;
}

/*
 * Drop finished execs beyond the count and byte budgets (MAX_FINISHED, -R), oldest first:
 * first those whose EXIT went out (the edge has the result and should have sent RELEASE),
 * then those no connection follows (an edge that restarts may still ATTACH). Never `keep`,
 * and never one whose EXIT the current connection has not been sent yet: its client is
 * waiting for that result, which would otherwise be lost (it would wait forever).
 */
static void exec_evict(struct exec *keep)
{
	for (;;) {
		int n = 0;
		size_t bytes = 0;
		struct exec *sent = NULL, *detached = NULL;
		for (struct exec *e = G.execs; e; e = e->next) {
			if (e->phase != PH_DONE)
				continue;
			n++;
			bytes += e->out[0].alloc + e->out[1].alloc;
			if (e == keep)
				continue;
			if (!attached(e)) {
				if (!detached || e->seq < detached->seq)
					detached = e;
			} else if (e->exit_sent && (!sent || e->seq < sent->seq)) {
				sent = e;
			}
		}
		struct exec *old = sent ? sent : detached;
		if (!old || (n <= MAX_FINISHED && bytes <= G.retain_max))
			return;
		exec_free(old);
	}
}

static void set_exit(struct exec *e, int status)
{
	if (WIFEXITED(status)) {
		e->exit_code = WEXITSTATUS(status);
		e->sig = 0;
	} else {
		e->exit_code = -1;
		e->sig = WIFSIGNALED(status) ? WTERMSIG(status) : SIGKILL;
	}
}

static void exec_done(struct exec *e)
{
	e->phase = PH_DONE;
	e->seq = ++G.seq;
	G.running--;
	if (e->timed_out) {
		e->exit_code = -1;
		e->sig = SIGKILL;
	}
	free(e->script);
	e->script = NULL;
	free_strv(e->env);
	e->env = NULL;
	rbuf_free(&e->chk[0]);
	rbuf_free(&e->chk[1]);
	for (int st = 0; st < 2; st++) { /* retained for a while: give back the slack */
		struct rbuf *r = &e->out[st];
		char *np;
		if (!r->len)
			rbuf_free(r);
		else if (r->alloc > r->len && (np = realloc(r->p, r->len))) {
			r->p = np;
			r->alloc = r->len;
		}
	}
	if (e->failed_err) { /* the command never ran: answer ERROR, keep nothing */
		if (attached(e))
			send_err(e->chan, e->failed_err, "%s%s%s: %s", stage_name(e->failed_stage),
				 e->failed_stage == ST_CHDIR ? " " : "", e->failed_stage == ST_CHDIR ? (e->cwd ? e->cwd : G.workdir) : "",
				 strerror(e->failed_err));
		exec_free(e);
		return;
	}
	if (e->auto_release && !attached(e)) {
		exec_free(e);
		return;
	}
	exec_evict(e);
}

static void send_exit(struct exec *e)
{
	uint8_t b[28];
	put32(b, (uint32_t)e->exit_code);
	put32(b + 4, (uint32_t)e->sig);
	b[8] = (uint8_t)e->timed_out;
	b[9] = (uint8_t)e->truncated;
	b[10] = (uint8_t)e->session_ended;
	b[11] = 0;
	put64(b + 12, e->total[0]);
	put64(b + 20, e->total[1]);
	out_frame(T_EXIT, e->chan, b, sizeof b, NULL, 0);
}

/* Queue unsent retained output (stdout first), then EXIT. Returns 1 if `e` was freed. */
static int exec_pump(struct exec *e)
{
	if (!attached(e))
		return 0;
	for (int st = 0; st < 2; st++)
		while (e->sent[st] < e->out[st].len) {
			if (G.out.len >= OUTQ_PACE || !e->credit) /* no credit: it waits here, retained */
				return 0;
			size_t n = e->out[st].len - e->sent[st];
			if (n > FRAME_CHUNK)
				n = FRAME_CHUNK;
			if (e->credit > 0 && (int64_t)n > e->credit)
				n = (size_t)e->credit;
			if (out_frame(st ? T_STDERR : T_STDOUT, e->chan, e->out[st].p + e->sent[st], n, NULL, 0) < 0)
				return 0;
			e->sent[st] += n;
			if (e->credit > 0)
				e->credit -= (int64_t)n;
		}
	if (e->phase == PH_DONE && !e->exit_sent) {
		send_exit(e);
		e->exit_sent = 1;
		if (e->auto_release) {
			exec_free(e);
			return 1;
		}
		G.evict_due = 1; /* it may be evicted now: pump_all checks the budgets */
	}
	return 0;
}
