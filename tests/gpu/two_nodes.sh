#!/usr/bin/env bash
# Two "nodes" on one multi-GPU host (issue 32): a rank killed on node B must be named
# by node A's daemon from NCCL RAS within 30 s, and both daemons' alerts must group
# into one incident in a real Alertmanager.
#
#   sudo PYTHON=.venv/bin/python tests/gpu/two_nodes.sh OUT [--dry-run] [HARNESS ARGS...]
#
# Makes two network namespaces gw-a and gw-b, each with one end of a veth pair
# (gw-a-veth 10.77.0.1/24, gw-b-veth 10.77.0.2/24) whose other end sits on the bridge
# gw-br0 (10.77.0.254/24, where Alertmanager listens), splits the GPUs in two halves
# and runs tests/gpu/two_nodes.py, which starts Alertmanager, one daemon per namespace
# and the job. The trap removes the namespaces, the veths and the bridge and ends
# whatever the harness started (OUT/pids.txt, checked by start time) or left in the
# namespaces, on every exit. Exit: the harness's (0 both hold, 1 not), 2 refused.
#
# --dry-run: no root, no GPU, no namespaces: both daemons on 127.0.0.1 with a
# replayed NVML capture and fake ranks; the harness's plumbing and this trap only.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PYTHON=${PYTHON:-python3}
NS_A=gw-a NS_B=gw-b BRIDGE=gw-br0
IF_A=gw-a-veth IF_B=gw-b-veth BR_A=gw-a-br BR_B=gw-b-br
ADDR_A=10.77.0.1 ADDR_B=10.77.0.2 ADDR_AM=10.77.0.254

refuse() {
	echo "two_nodes.sh: $*" >&2
	exit 2
}

[[ $# -ge 1 && $1 != -* ]] || refuse "usage: two_nodes.sh OUT [--dry-run] [harness args]"
OUT=$1
shift
DRY=0
if [[ ${1:-} == --dry-run ]]; then
	DRY=1
	shift
fi

GPUS=0
if ((!DRY)); then
	[[ $EUID -eq 0 ]] || refuse "needs root (network namespaces, a bridge)"
	command -v ip >/dev/null || refuse "needs ip (iproute2)"
	GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
	((GPUS >= 2)) || refuse "needs at least 2 GPUs (nvidia-smi -L lists $GPUS)"
	for ns in $NS_A $NS_B; do
		[[ ! -e /run/netns/$ns ]] || refuse "network namespace $ns exists already: another run?"
	done
	! ip link show $BRIDGE >/dev/null 2>&1 || refuse "link $BRIDGE exists already: another run?"
fi

mkdir -p "$OUT" || refuse "cannot make $OUT"
OUT=$(cd "$OUT" && pwd)
: >"$OUT/pids.txt"
MADE=()

start_time() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | awk '{print $20}'; }
running() { [[ -e /proc/$1 && $(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1) != Z ]]; }

cleanup() {
	local rc=$? pid start name left=0 killed=() i
	trap - EXIT INT TERM
	{
		echo "cleanup after exit $rc"
		while read -r pid start name; do
			[[ -n $pid && -e /proc/$pid && $(start_time "$pid") == "$start" ]] || continue
			kill -KILL "$pid" 2>/dev/null || continue
			echo "killed $name (pid $pid)" && left=$((left + 1)) && killed+=("$pid")
		done <"$OUT/pids.txt"
		for ns in "${MADE[@]}"; do
			[[ $ns == netns:* ]] || continue
			for pid in $(ip netns pids "${ns#netns:}" 2>/dev/null); do
				kill -KILL "$pid" 2>/dev/null || continue
				echo "killed pid $pid in ${ns#netns:}" && left=$((left + 1)) && killed+=("$pid")
			done
		done
		for pid in "${killed[@]}"; do # gone before their namespaces go
			for ((i = 0; i < 50; i++)); do running "$pid" && sleep 0.1 || break; done
			! running "$pid" || echo "pid $pid still runs after SIGKILL"
		done
		for ((i = ${#MADE[@]} - 1; i >= 0; i--)); do
			case ${MADE[i]} in
			netns:*) ip netns del "${MADE[i]#netns:}" && echo "deleted namespace ${MADE[i]#netns:}" ;;
			link:*) ip link del "${MADE[i]#link:}" 2>/dev/null && echo "deleted link ${MADE[i]#link:}" ;;
			esac
		done
		echo "processes left over: $left"
	} >>"$OUT/cleanup.log" 2>&1
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ARGS=()
if ((DRY)); then
	ARGS+=(--dry-run --warm 1 --deadline 2 --start-timeout 20)
else
	must() { "$@" || { echo "two_nodes.sh: failed: $*" >&2; exit 1; }; }
	must ip link add $BRIDGE type bridge
	MADE+=("link:$BRIDGE")
	must ip addr add $ADDR_AM/24 dev $BRIDGE
	must ip link set $BRIDGE up
	for side in a b; do
		ns=gw-$side veth=gw-$side-veth peer=gw-$side-br addr=$ADDR_A
		[[ $side == b ]] && addr=$ADDR_B
		must ip netns add "$ns"
		MADE+=("netns:$ns")
		must ip link add "$veth" type veth peer name "$peer"
		MADE+=("link:$peer")
		must ip link set "$veth" netns "$ns"
		must ip link set "$peer" master $BRIDGE up
		must ip -n "$ns" addr add "$addr/24" dev "$veth"
		must ip -n "$ns" link set "$veth" up
		must ip -n "$ns" link set lo up
	done
	K=$((GPUS / 2))
	HALF_A=$(seq -s, 0 $((K - 1)))
	HALF_B=$(seq -s, $K $((2 * K - 1)))
	ARGS+=(--ranks-per-node "$K" --gpus-a "$HALF_A" --gpus-b "$HALF_B")
	ARGS+=(--netns-a $NS_A --netns-b $NS_B --addr-a $ADDR_A --addr-b $ADDR_B)
	ARGS+=(--ifname-a $IF_A --ifname-b $IF_B --am-addr $ADDR_AM)
	ARGS+=(--daemon-port-a 9400 --daemon-port-b 9400 --master-port 29500)
fi

cd "$ROOT" || exit 2
"$PYTHON" "$HERE/two_nodes.py" "$OUT" "${ARGS[@]}" "$@"
