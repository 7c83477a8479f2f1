// SPDX-License-Identifier: (MIT OR GPL-2.0)
/*
 * dsec per-sandbox network policy: cgroup-BPF programs attached to each sandbox's cgroup v2
 * directory. One loaded copy serves every sandbox of an edge; policy is looked up by the
 * cgroup id of the sandbox, so a policy change is a map update (no reload, no re-attach).
 *
 * Default deny. Always allowed: loopback inside the sandbox's own network namespace
 * (127.0.0.0/8, ::1, and 0.0.0.0 / :: which the kernel delivers locally).
 *
 *   cgroup/sock_create   only TCP and UDP sockets (no raw, ICMP "ping", SCTP, MPTCP, UDP-Lite)
 *   cgroup/connect4,6    TCP connect (incl. TCP Fast Open sendto), connected UDP
 *   cgroup/sendmsg4,6    unconnected UDP sendto/sendmsg (DNS exfiltration)
 *   cgroup_skb/egress    every packet a socket of the sandbox sends out of its namespace
 *                        (anything but loopback): catches established connections after a
 *                        policy is narrowed, and anything the socket hooks do not see.
 *                        Non-TCP/UDP packets are dropped; later IP fragments carry no ports,
 *                        so for them the destination address and protocol decide.
 *
 * Maps (LPM tries keyed by cgroup id then destination address):
 *   dsec_pol4  key {prefixlen = 64 + cidr bits, cgid (8 bytes), IPv4 address}
 *   dsec_pol6  key {prefixlen = 64 + cidr bits, cgid (8 bytes), IPv6 address}
 *   value: up to MAX_RANGES (port range, protocol mask). User space stores in each prefix the
 *   ranges of every rule whose network contains it, so the longest match alone decides.
 * IPv4-mapped IPv6 destinations (::ffff:a.b.c.d on dual-stack sockets) are checked as IPv4.
 */
#include <linux/bpf.h>
#include <linux/in.h>

#define SEC(name) __attribute__((section(name), used))
#define __uint(name, val) int (*name)[val]
#define __type(name, val) typeof(val) *name
#define INLINE static inline __attribute__((always_inline))

static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)BPF_FUNC_map_lookup_elem;
static long (*bpf_skb_load_bytes)(const void *skb, __u32 offset, void *to, __u32 len) =
	(void *)BPF_FUNC_skb_load_bytes;
static __u64 (*bpf_get_current_cgroup_id)(void) = (void *)BPF_FUNC_get_current_cgroup_id;
static __u64 (*bpf_skb_cgroup_id)(struct __sk_buff *skb) = (void *)BPF_FUNC_skb_cgroup_id;

#define bswap16(x) __builtin_bswap16(x)
#define bswap32(x) __builtin_bswap32(x)

#define AF_INET 2
#define AF_INET6 10
#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD
#define LOOPBACK_IFINDEX 1

#define PROTO_TCP 1
#define PROTO_UDP 2
#define ANY_PORT 0xFFFFFFFF
#define MAX_RANGES 16

struct key4 {
	__u32 prefixlen;
	__u32 cg[2];
	__u32 addr;
};

struct key6 {
	__u32 prefixlen;
	__u32 cg[2];
	__u32 addr[4];
};

struct range {
	__u16 lo;
	__u16 hi;
	__u32 protos;
};

struct rule {
	__u32 n;
	__u32 pad;
	struct range r[MAX_RANGES];
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct key4);
	__type(value, struct rule);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} dsec_pol4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct key6);
	__type(value, struct rule);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} dsec_pol6 SEC(".maps");

INLINE __u32 proto_bit(__u32 protocol)
{
	if (protocol == IPPROTO_TCP)
		return PROTO_TCP;
	if (protocol == IPPROTO_UDP)
		return PROTO_UDP;
	return 0;
}

INLINE int ranges_allow(const struct rule *v, __u32 port, __u32 proto)
{
	__u32 n = v->n;
	for (int i = 0; i < MAX_RANGES; i++) {
		if (i >= n)
			break;
		if (!(v->r[i].protos & proto))
			continue;
		if (port == ANY_PORT || (port >= v->r[i].lo && port <= v->r[i].hi))
			return 1;
	}
	return 0;
}

INLINE int local4(__u32 addr_be)
{
	return addr_be == 0 || (bswap32(addr_be) >> 24) == 127;
}

INLINE int check4(__u64 cgid, __u32 addr_be, __u32 port, __u32 proto)
{
	struct key4 k = {};
	k.prefixlen = 64 + 32;
	__builtin_memcpy(k.cg, &cgid, sizeof(cgid));
	k.addr = addr_be;
	struct rule *v = bpf_map_lookup_elem(&dsec_pol4, &k);
	return v ? ranges_allow(v, port, proto) : 0;
}

INLINE int check6(__u64 cgid, const __u32 a[4], __u32 port, __u32 proto)
{
	struct key6 k = {};
	k.prefixlen = 64 + 128;
	__builtin_memcpy(k.cg, &cgid, sizeof(cgid));
	k.addr[0] = a[0];
	k.addr[1] = a[1];
	k.addr[2] = a[2];
	k.addr[3] = a[3];
	struct rule *v = bpf_map_lookup_elem(&dsec_pol6, &k);
	return v ? ranges_allow(v, port, proto) : 0;
}

/* IPv6 destination of a socket call; v4-mapped addresses follow the IPv4 rules. */
INLINE int decide6(__u64 cgid, const __u32 a[4], __u32 port, __u32 proto)
{
	if (a[0] == 0 && a[1] == 0) {
		if (a[2] == bswap32(0xffff))
			return local4(a[3]) || check4(cgid, a[3], port, proto);
		if (a[2] == 0 && (a[3] == 0 || a[3] == bswap32(1)))
			return 1; /* :: and ::1 are local */
	}
	return check6(cgid, a, port, proto);
}

INLINE int sock_addr4(struct bpf_sock_addr *ctx)
{
	__u32 addr = ctx->user_ip4;
	if (local4(addr))
		return 1;
	__u32 proto = proto_bit(ctx->protocol);
	if (!proto)
		return 0;
	__u32 port = bswap16((__u16)ctx->user_port);
	return check4(bpf_get_current_cgroup_id(), addr, port, proto);
}

INLINE int sock_addr6(struct bpf_sock_addr *ctx)
{
	__u32 a[4];
	a[0] = ctx->user_ip6[0];
	a[1] = ctx->user_ip6[1];
	a[2] = ctx->user_ip6[2];
	a[3] = ctx->user_ip6[3];
	__u32 proto = proto_bit(ctx->protocol);
	if (!proto)
		return 0;
	__u32 port = bswap16((__u16)ctx->user_port);
	return decide6(bpf_get_current_cgroup_id(), a, port, proto);
}

SEC("cgroup/connect4")
int dsec_connect4(struct bpf_sock_addr *ctx) { return sock_addr4(ctx); }

SEC("cgroup/sendmsg4")
int dsec_sendmsg4(struct bpf_sock_addr *ctx) { return sock_addr4(ctx); }

SEC("cgroup/connect6")
int dsec_connect6(struct bpf_sock_addr *ctx) { return sock_addr6(ctx); }

SEC("cgroup/sendmsg6")
int dsec_sendmsg6(struct bpf_sock_addr *ctx) { return sock_addr6(ctx); }

SEC("cgroup/sock_create")
int dsec_sock(struct bpf_sock *sk)
{
	if (sk->family != AF_INET && sk->family != AF_INET6)
		return 1; /* this hook only sees inet sockets; be explicit anyway */
	if (sk->protocol == IPPROTO_TCP && sk->type == 1 /* SOCK_STREAM */)
		return 1;
	if (sk->protocol == IPPROTO_UDP && sk->type == 2 /* SOCK_DGRAM */)
		return 1;
	return 0;
}

struct ip4hdr {
	__u8 vihl;
	__u8 tos;
	__u16 len;
	__u16 id;
	__u16 frag;
	__u8 ttl;
	__u8 proto;
	__u16 csum;
	__u32 saddr;
	__u32 daddr;
};

SEC("cgroup_skb/egress")
int dsec_egress(struct __sk_buff *skb)
{
	if (skb->ifindex == LOOPBACK_IFINDEX)
		return 1; /* stays inside the sandbox's own network namespace */
	__u64 cgid = bpf_skb_cgroup_id(skb);
	__u16 ports[2];

	if (skb->protocol == bswap16(ETH_P_IP)) {
		struct ip4hdr ip;
		if (bpf_skb_load_bytes(skb, 0, &ip, sizeof(ip)))
			return 0;
		__u32 proto = proto_bit(ip.proto);
		if (!proto)
			return 0;
		if (bswap16(ip.frag) & 0x1fff) /* later fragment: no ports, address decides */
			return check4(cgid, ip.daddr, ANY_PORT, proto);
		if (bpf_skb_load_bytes(skb, (ip.vihl & 0xf) * 4, ports, sizeof(ports)))
			return 0;
		return check4(cgid, ip.daddr, bswap16(ports[1]), proto);
	}
	if (skb->protocol == bswap16(ETH_P_IPV6)) {
		__u8 nh;
		__u32 a[4];
		if (bpf_skb_load_bytes(skb, 6, &nh, 1) || bpf_skb_load_bytes(skb, 24, a, sizeof(a)))
			return 0;
		__u32 off = 40;
		__u32 port = 0;
		int later_fragment = 0;
		for (int i = 0; i < 4; i++) {
			__u8 ext[8];
			if (nh != 0 && nh != 43 && nh != 60 && nh != 44)
				break; /* not hop-by-hop, routing, destination options or fragment */
			if (bpf_skb_load_bytes(skb, off, ext, sizeof(ext)))
				return 0;
			if (nh == 44) {
				if (((ext[2] << 8) | ext[3]) & 0xfff8)
					later_fragment = 1;
				off += 8;
			} else {
				off += (ext[1] + 1) * 8;
			}
			nh = ext[0];
		}
		__u32 proto = proto_bit(nh);
		if (!proto)
			return 0;
		if (later_fragment) {
			port = ANY_PORT;
		} else {
			if (bpf_skb_load_bytes(skb, off, ports, sizeof(ports)))
				return 0;
			port = bswap16(ports[1]);
		}
		return check6(cgid, a, port, proto);
	}
	return 0;
}

char _license[] SEC("license") = "Dual MIT/GPL";
