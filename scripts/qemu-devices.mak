# The devices Clade's own QEMU is built with (scripts/build-qemu): the microvm
# machine and the four virtio-mmio devices a sandbox has (launch::qemu_args).
# The machine selects what it needs itself (serial port, APIC, i8259, PIT).
# Every other device model of QEMU stays out of the binary: less code facing
# the guest, and ~6 MiB less memory per sandbox (ADR 13).
CONFIG_MICROVM=y
CONFIG_VIRTIO_MMIO=y
CONFIG_VIRTIO_BLK=y
CONFIG_VIRTIO_NET=y
CONFIG_VIRTIO_RNG=y
CONFIG_VIRTIO_SERIAL=y
