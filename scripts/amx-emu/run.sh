#!/usr/bin/env bash
# Run cachet-kernels' AMX tests on an emulated AMX CPU, for machines without one.
#
# The guest is Debian's Linux kernel booted in Bochs 3.0. The emulated CPU is Bochs's
# Skylake-X model plus AVX512-VNNI, AMX-TILE and AMX-INT8 (bochs-3.0-amx.patch). The patch also
# adds XFD, without which Linux does not enable tile state, and fixes Bochs's signed AMX dot
# products (it treated signed bytes as unsigned). The guest's init (guest-init.c) runs the
# AMX unit tests and the matmul tests on every ISA level, AMX included. Each test reports
# "=== exit status"; this script fails unless all of them are 0.
#
# Usage: scripts/amx-emu/run.sh    (about 4 minutes once Bochs is built; first run +3 min)
# Needs: curl, g++, make, cpio, genisoimage, apt (Debian). As root it installs what is
# missing; otherwise it skips with a warning, as does a CPU with AMX of its own (the native
# test run covers that). Work files: ${CACHET_AMX_EMU_DIR:-~/.cache/cachet/amx-emu}.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
work=${CACHET_AMX_EMU_DIR:-$HOME/.cache/cachet/amx-emu}
mkdir -p "$work"
cd "$work"

if grep -q "amx_tile" /proc/cpuinfo 2>/dev/null; then
	echo "amx-emu: this CPU has AMX; the native test run covers the AMX level, skipping emulation"
	exit 0
fi
skip() {
	echo "warning: amx-emu skipped: $1" >&2
	exit 0
}
apt_updated=0
need() { # command, Debian package
	command -v "$1" >/dev/null && return
	if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
		if [ $apt_updated = 0 ]; then apt-get update -qq && apt_updated=1; fi
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >/dev/null
	fi
	command -v "$1" >/dev/null || skip "needs $1 (Debian package $2) and not root"
}
need curl curl
need cpio cpio
need genisoimage genisoimage
need g++ g++
need apt-cache apt

bochs_tar=bochs_3.0+dfsg.orig.tar.xz
bochs_sha=78f6c73d4a6472d5130a87ab9dc306d02c7c71ed8e25b3a8ef642e2a7acd282b
patch_sum=$(sha256sum "$here/bochs-3.0-amx.patch" | cut -c1-16)
if [ ! -x "bochs-3.0/bochs" ] || [ "$(cat bochs-3.0/.cachet-patch 2>/dev/null)" != "$patch_sum" ]; then
	echo "amx-emu: building Bochs 3.0 with the AMX patch"
	[ -f "$bochs_tar" ] || curl -fsSLO "http://deb.debian.org/debian/pool/main/b/bochs/$bochs_tar"
	echo "$bochs_sha  $bochs_tar" | sha256sum -c --quiet
	rm -rf bochs-3.0
	tar xf "$bochs_tar"
	(
		cd bochs-3.0
		patch -p1 -s <"$here/bochs-3.0-amx.patch"
		./configure -q --enable-x86-64 --enable-cpu-level=6 --enable-avx --enable-evex \
			--enable-amx --enable-all-optimizations --with-nogui --enable-pci \
			--disable-debugger --enable-cdrom >configure.log
		make -s -j"$(nproc)" >make.log 2>&1
		echo "$patch_sum" >.cachet-patch
	)
fi

# Guest kernel, VGA BIOS and ISO boot loader from Debian's packages (bookworm).
if [ ! -f vmlinuz ] || [ ! -f isolinux.bin ] || [ ! -f vgabios.bin ]; then
	rm -rf debs && mkdir debs
	kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
	if [ -z "$kpkg" ] && [ "$(id -u)" = 0 ] && [ $apt_updated = 0 ]; then
		apt-get update -qq && apt_updated=1
		kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
	fi
	[ -n "$kpkg" ] || skip "apt cannot resolve linux-image-amd64 (run apt-get update)"
	(cd debs && apt-get download -q "$kpkg" vgabios isolinux syslinux-common >/dev/null 2>&1)
	for d in debs/*.deb; do dpkg-deb -x "$d" debs/root; done
	cp debs/root/boot/vmlinuz-* vmlinuz
	cp debs/root/usr/share/vgabios/vgabios.bin vgabios.bin
	cp debs/root/usr/lib/ISOLINUX/isolinux.bin isolinux.bin
	cp debs/root/usr/lib/syslinux/modules/bios/ldlinux.c32 ldlinux.c32
	rm -rf debs
fi

# Static test binaries of cachet-kernels (the guest has no libc of its own).
echo "amx-emu: building the kernel tests (static)"
tests=$(cd "$root" && RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR="$work/target" \
	cargo test -q -p cachet-kernels --release --target x86_64-unknown-linux-gnu --no-run \
	--message-format=json 2>/dev/null |
	python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("cachet_kernels", "correctness"):
        print(m["target"]["name"], m["executable"])')
rm -rf initrd iso && mkdir -p initrd/bin initrd/dev initrd/proc iso/isolinux
while read -r name exe; do
	case $name in cachet_kernels) cp "$exe" initrd/bin/lib ;; correctness) cp "$exe" initrd/bin/correctness ;; esac
done <<<"$tests"
[ -x initrd/bin/lib ] && [ -x initrd/bin/correctness ] || { echo "amx-emu: test binaries not found" >&2; exit 1; }
gcc -O2 -static -o initrd/init "$here/guest-init.c"
(cd initrd && find . | cpio -o -H newc 2>/dev/null | gzip -1) >iso/initrd.gz
cp vmlinuz iso/vmlinuz
cp isolinux.bin ldlinux.c32 iso/isolinux/
cat >iso/isolinux/isolinux.cfg <<'EOF'
DEFAULT t
PROMPT 0
TIMEOUT 0
LABEL t
  KERNEL /vmlinuz
  APPEND initrd=/initrd.gz console=ttyS0,115200 rdinit=/init quiet lpj=1000000 lsm=capability acpi=off
EOF
genisoimage -quiet -o guest.iso -b isolinux/isolinux.bin -c isolinux/boot.cat -no-emul-boot \
	-boot-load-size 4 -boot-info-table -J -R iso

cat >bochsrc <<EOF
megs: 1024
cpu: model=corei7_skylake_x, count=1, ips=400000000
romimage: file=$work/bochs-3.0/bios/bios.bin-1.13.0
vgaromimage: file=$work/vgabios.bin
vga: extension=vbe
pci: enabled=1, chipset=i440fx
ata0-master: type=cdrom, path=$work/guest.iso, status=inserted
boot: cdrom
com1: enabled=1, mode=file, dev=$work/serial.txt
display_library: nogui
log: $work/bochs.log
panic: action=fatal
error: action=ignore
info: action=ignore
clock: sync=none
EOF
rm -f serial.txt
echo "amx-emu: booting the guest (serial log: $work/serial.txt)"
timeout 1200 ./bochs-3.0/bochs -q -f bochsrc >bochs.out 2>&1 &
pid=$!
for _ in $(seq 1200); do
	grep -q "^=== done" serial.txt 2>/dev/null && break
	kill -0 "$pid" 2>/dev/null || break
	sleep 1
done
sleep 2
kill "$pid" 2>/dev/null || true
wait "$pid" 2>/dev/null || true

grep -E "^(model name|flags|=== |test |AMX:)" serial.txt || true
statuses=$(grep -c "^=== exit status" serial.txt || true)
failed=$(grep "^=== exit status" serial.txt | grep -vc "^=== exit status: 0 (signal 0)" || true)
if ! grep -q "^=== done" serial.txt || [ "$statuses" -ne 4 ] || [ "$failed" -ne 0 ]; then
	echo "amx-emu: FAILED ($statuses runs reported, $failed failed); see $work/serial.txt" >&2
	exit 1
fi
grep -q "amx_tile" serial.txt && grep -q "AMX: in use; detected level: amx" serial.txt || {
	echo "amx-emu: the guest did not run the AMX level; see $work/serial.txt" >&2
	exit 1
}
echo "amx-emu: all AMX tests passed on the emulated CPU"
