#!/bin/sh
# PID 1 of the test VM (busybox sh). The host's harness (tests/src/vm/mod.rs) boots it and
# reads the executor's ready line from the serial console.
export PATH=/usr/local/bin:/bin

# Stage 1, in the initramfs: move into a tmpfs and switch_root, as a real boot does. pivot_root
# (the strict profile's new root) cannot leave the initramfs, whose root is not a mount.
if [ ! -e /.tmpfs-root ]; then
    mount -t devtmpfs devtmpfs /dev
    exec </dev/console >/dev/console 2>&1
    mkdir /newroot
    mount -t tmpfs -o mode=0755 root /newroot
    for entry in /*; do
        case "$entry" in /newroot | /dev) ;; *) cp -a "$entry" /newroot/ ;; esac
    done
    mkdir -p /newroot/dev
    mount --move /dev /newroot/dev
    touch /newroot/.tmpfs-root
    exec switch_root /newroot /init
fi

# Stage 2, in the tmpfs.
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 shm /dev/shm
# cgroup_no_v1=all on the kernel command line: a pure cgroup v2 host.
mount -t cgroup2 cgroup2 /sys/fs/cgroup
hostname executor-vm

# The cloud kernel builds virtio as modules; there is no udev or modules.dep here, so load
# them in the dependency order the image lists them in.
for module in $(cat /etc/vm-modules); do
    insmod "/lib/modules/$module.ko" || echo "vm-init: insmod $module failed"
done

# qemu's user-mode network: the guest is 10.0.2.15, the host's forwarded ports arrive there.
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2

# The side channel: a root shell on the virtio-serial port named "side". Reading it returns
# end of file while the host is not connected; the loop opens it again.
side=""
for port in /sys/class/virtio-ports/*; do
    [ "$(cat "$port/name" 2>/dev/null)" = side ] && side="/dev/${port##*/}"
done
if [ -n "$side" ]; then
    (
        while :; do
            sh -s <>"$side" >&0 2>&0
            sleep 0.2
        done
    ) &
else
    echo "vm-init: no side channel port"
fi

# The daemon's cgroup, as systemd gives a service with Delegate=yes: its own
# system.slice/executor.service, with the pids and memory controllers enabled down to it. The
# daemon starts in it (not in the root cgroup, which is exempt from the "no internal processes"
# rule), so it must move into a leaf of its own before it can enable them for its commands.
service=/sys/fs/cgroup/system.slice/executor.service
echo "+pids +memory" >/sys/fs/cgroup/cgroup.subtree_control
mkdir -p "$service"
echo "+pids +memory" >/sys/fs/cgroup/system.slice/cgroup.subtree_control

# The daemon, as a remote VM runs it: TLS on every address, a token placed by the host.
# Its ready line (with the certificate fingerprint) goes to the console, its log to a file.
# The image lists the profiles to offer (/etc/executor/serve-flags: --allow-profile NAME ...).
# The shell joins the service's cgroup, then becomes the daemon (same pid).
RUST_LOG=info sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$service" \
    executor serve --listen 0.0.0.0:7681 --tls --token-file /etc/executor-token \
    --profiles-dir /etc/executor/profiles $(cat /etc/executor/serve-flags) \
    >/dev/console 2>/var/log/executor.log &
echo "vm-init: executor started as pid $! in $service"

# PID 1 reaps whatever is orphaned to it, forever.
while :; do
    wait
    sleep 1
done
