// Package libnbd stands in for the Go binding of libguestfs' libnbd, which
// the Go module proxy this machine reaches refuses (403). CDI links it only
// for its VDDK importer (vSphere through VMware's closed library); the HTTP
// import vmmigrate uses never calls it. Every call fails, so an attempt to
// use the VDDK path reports that clearly instead of misbehaving.
package libnbd

import "errors"

var errMissing = errors.New("libnbd is not available in this build (vmmigrate test environment)")

const (
	CMD_FLAG_REQ_ONE          = uint32(0x08)
	STATE_HOLE                = uint32(1)
	STATE_ZERO                = uint32(2)
	STATE_DIRTY               = uint32(1)
	CONTEXT_BASE_ALLOCATION   = "base:allocation"
	CONTEXT_QEMU_DIRTY_BITMAP = "qemu:dirty-bitmap:"
)

type LibnbdError struct{ Op, Errmsg string }

func (e *LibnbdError) Error() string { return e.Op + ": " + e.Errmsg }

type Libnbd struct{}

type ExtentCallback func(metacontext string, offset uint64, entries []uint32, err *int) int

type PreadOptargs struct {
	FlagsSet bool
	Flags    uint32
}

type BlockStatusOptargs struct {
	FlagsSet bool
	Flags    uint32
}

func Create() (*Libnbd, error) { return nil, errMissing }

func (h *Libnbd) AddMetaContext(string) error { return errMissing }
func (h *Libnbd) ConnectUri(string) error     { return errMissing }
func (h *Libnbd) GetSize() (uint64, error)    { return 0, errMissing }
func (h *Libnbd) Pread([]byte, uint64, *PreadOptargs) error {
	return errMissing
}
func (h *Libnbd) BlockStatus(uint64, uint64, ExtentCallback, *BlockStatusOptargs) error {
	return errMissing
}
func (h *Libnbd) Close() *LibnbdError { return nil }

// What KubeVirt's virt-launcher links for its changed-block-tracking NBD
// map (backup), which the tests never ask for.

type LibnbdExtent struct {
	Length uint64
	Flags  uint64
}

type Extent64Callback func(metacontext string, offset uint64, entries []LibnbdExtent, err *int) int

type BlockStatus64Optargs struct {
	FlagsSet bool
	Flags    uint32
}

func (h *Libnbd) CanMetaContext(string) (bool, error) { return false, errMissing }
func (h *Libnbd) ConnectUnix(string) error             { return errMissing }
func (h *Libnbd) SetExportName(string) error           { return errMissing }
func (h *Libnbd) BlockStatus64(uint64, uint64, Extent64Callback, *BlockStatus64Optargs) error {
	return errMissing
}
