# Sourced by the Dockerfiles' install steps: the PIP_* build arguments that were given (empty
# ones unset, so pip keeps its defaults) and the CA bundle secret, for this RUN step only.
for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST; do
    eval "[ -n \"\${$v:-}\" ]" && eval "export $v" || unset "$v"
done
if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
