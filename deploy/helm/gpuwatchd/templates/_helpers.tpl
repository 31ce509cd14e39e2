{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "gpuwatchd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpuwatchd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "gpuwatchd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuwatchd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gpuwatchd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "gpuwatchd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: node-agent
{{- end -}}

{{- define "gpuwatchd.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "gpuwatchd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gpuwatchd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* "true" when the daemon reads a web-config.yml (TLS and/or basic auth). */}}
{{- define "gpuwatchd.webConfig" -}}
{{- $w := .Values.webConfig -}}
{{- if or $w.existingSecret $w.basicAuthUsers $w.tls.enabled -}}true{{- end -}}
{{- end -}}

{{- define "gpuwatchd.scheme" -}}
{{- if .Values.webConfig.tls.enabled -}}HTTPS{{- else -}}HTTP{{- end -}}
{{- end -}}

{{/* The daemon's config.yaml: chart settings, then .Values.config over them. */}}
{{- define "gpuwatchd.config" -}}
{{- $kmsg := dict "enabled" true -}}
{{- $mode := .Values.kernelLog.mode -}}
{{- if eq $mode "auto" -}}{{- $_ := set $kmsg "backend" "auto" -}}
{{- else if eq $mode "journal" -}}{{- $_ := set $kmsg "backend" "journald" -}}
{{- else if eq $mode "kmsg" -}}{{- $_ := set $kmsg "backend" "kmsg" -}}
{{- else if eq $mode "file" -}}{{- $_ := set $kmsg "backend" "file" -}}{{- $_ := set $kmsg "file" (printf "/host%s" .Values.kernelLog.file) -}}
{{- else -}}{{- $_ := set $kmsg "enabled" false -}}
{{- end -}}
{{- $http := dict "listen" (printf "0.0.0.0:%d" (int .Values.port)) -}}
{{- if include "gpuwatchd.webConfig" . -}}
{{- $_ := set $http "web_config_file" "/etc/gpuwatchd/web/web-config.yml" -}}
{{- end -}}
{{- $base := dict
  "http" $http
  "paths" (dict "sysfs" "/host/sys" "procfs" "/host/proc" "dev_shm" "/host/dev/shm")
  "daemon" (dict "state_dir" "/var/lib/gpuwatchd")
  "sources" (dict "kmsg" $kmsg)
-}}
{{- toYaml (mustMergeOverwrite $base (deepCopy .Values.config)) -}}
{{- end -}}


{{/* "true" when a monitoring.coreos.com/v1 kind should be rendered: `enabled` true, or
     "auto" and the cluster serves that kind. Call with (list . "ServiceMonitor" $enabled). */}}
{{- define "gpuwatchd.monitoringEnabled" -}}
{{- $root := index . 0 -}}
{{- $kind := index . 1 -}}
{{- $enabled := index . 2 -}}
{{- if eq (toString $enabled) "auto" -}}
{{- if $root.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" $kind) -}}true{{- end -}}
{{- else if $enabled -}}true{{- end -}}
{{- end -}}

{{/* Kernel log mounts: /dev/kmsg in kmsg and auto modes, the journal in journal and auto. */}}
{{- define "gpuwatchd.kmsgMounted" -}}
{{- if has .Values.kernelLog.mode (list "auto" "kmsg") -}}true{{- end -}}
{{- end -}}
{{- define "gpuwatchd.journalMounted" -}}
{{- if has .Values.kernelLog.mode (list "auto" "journal") -}}true{{- end -}}
{{- end -}}
