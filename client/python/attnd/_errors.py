"""The one exception type of the attnd client."""
import grpc

_CODE_BY_VALUE = {status.value[0]: status for status in grpc.StatusCode}


def status_code_from_int(value):
    """Maps a google.rpc.Code number (as carried in SessionResponse.code) to a grpc.StatusCode."""
    return _CODE_BY_VALUE.get(int(value), grpc.StatusCode.UNKNOWN)


class AttndError(Exception):
    """A failed attnd call, or a request the client could not build.

    Attributes:
      code: a grpc.StatusCode (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, OUT_OF_RANGE,
        RESOURCE_EXHAUSTED, UNAVAILABLE, INTERNAL, DEADLINE_EXCEEDED, ...).
      message: the server's message (what was wrong and what was expected), or the client's.
    """

    def __init__(self, code, message):
        if not isinstance(code, grpc.StatusCode):
            code = status_code_from_int(code)
        self.code = code
        self.message = message
        super().__init__("%s: %s" % (code.name, message))

    def __reduce__(self):
        return (AttndError, (self.code, self.message))

    @classmethod
    def from_rpc_error(cls, err):
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


def invalid_argument(message):
    return AttndError(grpc.StatusCode.INVALID_ARGUMENT, message)
