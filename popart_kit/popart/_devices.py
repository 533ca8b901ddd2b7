"""popart.DeviceManager and DeviceInfo: devices a session runs on with the xla runtime.

Every device here runs on the xla backend, so a CPU or IPU-Model device may carry replicated
and multi-IPU sessions (PopART's own host targets cannot); an acquired "IPU" device is a
stand-in with the IPUs asked for.
"""

from __future__ import annotations

from typing import Any

from ._core import ENUMS, popart_exception

_IPU_MODEL_KEYS = ("numIPUs", "tilesPerIPU", "compileIPUCode", "ipuVersion")
_OFFLINE_KEYS = ("numIPUs", "tilesPerIPU", "ipuVersion", "syncPattern", "gatewayMode")
_SYNC_NAMES = {"full": "Full", "singlePipeline": "SinglePipeline",
               "replicaAndLadder": "ReplicaAndLadder"}


class DeviceInfo:
    """popart.DeviceInfo: the device type, its IPU count and tiles, attach/detach."""

    def __init__(self, type_: str, num_ipus: int, tiles: int, pattern: Any = None,
                 connection: Any = None, device_id: int = 0, version: str = "ipu2") -> None:
        self._type = ENUMS["DeviceType"][type_]
        self._num_ipus, self._tiles, self._id, self._version = num_ipus, tiles, device_id, version
        self.syncPattern = pattern or ENUMS["SyncPattern"].Full
        self._connection = connection or ENUMS["DeviceConnectionType"].Always
        self._attached = self._connection is ENUMS["DeviceConnectionType"].Always

    type = property(lambda self: self._type)  # noqa: A003
    numIpus = property(lambda self: self._num_ipus)
    tilesPerIPU = tilesPerIpu = property(lambda self: self._tiles)
    id = property(lambda self: self._id)  # noqa: A003
    version = ipuVersion = property(lambda self: self._version)
    connectionType = property(lambda self: self._connection)
    isAttached = property(lambda self: self._attached)
    driverIds = property(lambda self: list(range(self._id, self._id + self._num_ipus)))
    numWorkerContexts = property(lambda self: 6)

    def attach(self) -> bool:
        self._attached = True
        return True

    def tryAttachUntilTimeout(self) -> bool:
        return self.attach()

    def detach(self) -> None:
        self._attached = False

    def __enter__(self) -> DeviceInfo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        return (f"Device Type:{self._type.name} Connection Type:{self._connection.name} "
                f"Id:{self._id} Version:{self._version} NumIPUs:{self._num_ipus} "
                f"NumTilesPerIPU:{self._tiles}")

    __str__ = __repr__


def _int_option(opts: dict[str, Any], key: str, default: int, method: str) -> int:
    value = opts.get(key, default)
    try:
        return int(str(value))
    except ValueError:
        raise popart_exception(f"{method}: option {key}={value!r} is not an integer.") from None


def _check_keys(opts: Any, allowed: tuple[str, ...], method: str) -> dict[str, Any]:
    if not isinstance(opts, dict):
        raise TypeError(f"{method} takes a dict of options ({', '.join(allowed)}), got "
                        f"{opts!r}.")
    for key in opts:
        if key not in allowed:
            raise popart_exception(f"Invalid option `{key}' passed to {method}. Valid options "
                                   f"are {', '.join(allowed)}")
    return opts


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class DeviceManager:
    """popart.DeviceManager(): creates the devices sessions run on (all on the xla runtime)."""

    def createCpuDevice(self) -> DeviceInfo:
        return DeviceInfo("Cpu", 1, 1)

    def createIpuModelDevice(self, opts: dict[str, Any] | None = None, /) -> DeviceInfo:
        opts = _check_keys(opts or {}, _IPU_MODEL_KEYS, "DevicexManager::createHostDevice")
        return DeviceInfo("IpuModel", _int_option(opts, "numIPUs", 1, "createIpuModelDevice"),
                          _int_option(opts, "tilesPerIPU", 4, "createIpuModelDevice"),
                          version=str(opts.get("ipuVersion", "ipu2")))

    def createOfflineIPUDevice(self, opts: dict[str, Any]) -> DeviceInfo:
        opts = _check_keys(opts, _OFFLINE_KEYS, "createOfflineIPUDevice")
        sync = str(opts.get("syncPattern", "full"))
        if sync not in _SYNC_NAMES:
            raise popart_exception(f"Unknown syncPattern setting: {sync}. Use one of "
                                   f"{', '.join(_SYNC_NAMES)}.")
        return DeviceInfo("OfflineIpu", _int_option(opts, "numIPUs", 1, "createOfflineIPUDevice"),
                          _int_option(opts, "tilesPerIPU", 1472, "createOfflineIPUDevice"),
                          pattern=ENUMS["SyncPattern"][_SYNC_NAMES[sync]],
                          connection=ENUMS["DeviceConnectionType"].Never,
                          version=str(opts.get("ipuVersion", "ipu2")))

    def createOfflineIpuFromDeviceInfo(self, deviceInfo: DeviceInfo) -> DeviceInfo:
        return DeviceInfo("OfflineIpu", deviceInfo.numIpus, deviceInfo.tilesPerIPU,
                          connection=ENUMS["DeviceConnectionType"].Never)

    def acquireAvailableDevice(self, numIpus: int = 1, tilesPerIpu: int = 0,
                               pattern: Any = None, connectionType: Any = None,
                               selectionCriterion: Any = None) -> DeviceInfo:
        if connectionType is ENUMS["DeviceConnectionType"].Never:
            raise popart_exception("Trying to acquire a hardware device when connectionType is "
                                   "DeviceConnectionType::Never. Fix: use "
                                   "createOfflineIPUDevice to compile without a device.")
        if numIpus > 0 and not _power_of_two(numIpus):
            raise popart_exception(f"You have attempted to acquire {numIpus} IPUs. The number "
                                   f"of IPUs requested must be a power of two")
        return DeviceInfo("Ipu", max(numIpus, 1), tilesPerIpu or 1472, pattern, connectionType)

    tryAcquireAvailableDevice = acquireAvailableDevice

    def acquireDeviceById(self, id: int, pattern: Any = None,  # noqa: A002
                          connectionType: Any = None) -> DeviceInfo:
        """Device ids count as in a POD: ids 0.. are single IPUs; here every id is one IPU."""
        return DeviceInfo("Ipu", 1, 1472, pattern, connectionType, device_id=id)

    tryAcquireDeviceById = acquireDeviceById

    def enumerateDevices(self, pattern: Any = None, numIpus: int = 1, deviceType: Any = None,
                         connectionType: Any = None, tilesPerIPU: int = 0) -> list[DeviceInfo]:
        return [self.acquireAvailableDevice(numIpus, tilesPerIPU, pattern, connectionType)]

    def setOnDemandAttachTimeout(self, attachTimeout: int) -> None:
        self.attach_timeout = attachTimeout
