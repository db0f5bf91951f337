# Installs a package folder's locked dependencies (package-lock.json, dev ones
# included) with `npm ci` into a build folder, for tools the tests need.
# Usage: cmake -DNPM=npm -DSRC=annotate -DDIR=build/annotate_node -DSTAMP=file -DWHAT=text [-DHINT=text] -P npm_ci_dir.cmake
# (cmake/npm_ci.cmake includes it for the report's charting library.)
file(MAKE_DIRECTORY ${DIR})
if(NOT NPM)
  message(FATAL_ERROR "${WHAT}: npm not found; run scripts/deps.sh (installs nodejs and npm) and configure again")
endif()
file(COPY_FILE ${SRC}/package.json ${DIR}/package.json ONLY_IF_DIFFERENT)
file(COPY_FILE ${SRC}/package-lock.json ${DIR}/package-lock.json ONLY_IF_DIFFERENT)
execute_process(COMMAND ${NPM} ci --ignore-scripts --no-audit --no-fund --loglevel=error
  WORKING_DIRECTORY ${DIR} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${WHAT}: `npm ci` in ${DIR} failed (${rc}) installing ${SRC}/package-lock.json. Check network access "
    "to the npm registry or a populated npm cache; then build again. ${HINT}\n${out}${err}")
endif()
file(TOUCH ${STAMP})
